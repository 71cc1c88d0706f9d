// defines: the CPU decoder of MXFP4 tensors as Hugging Face checkpoints store them (GPT-OSS's expert weights): a
// tensor X is the pair X_blocks (u8 [..., G, 16]: 16 bytes, 32 fp4 e2m1 values, per block) and X_scales (u8 e8m0
// [..., G]: one power-of-two scale per block), decoded to f32 exactly as transformers 5.17 does it
// (integrations/mxfp4.py, convert_moe_packed_tensors), so a model loads from the released checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace moetrain::io {

inline constexpr int64_t kMxfp4BlockBytes = 16;   // bytes of one block (the last dim of X_blocks)
inline constexpr int64_t kMxfp4BlockValues = 32;  // fp4 values of one block, sharing one scale byte
// The scale byte e8m0 reserves for NaN (OCP MX spec). Refused: transformers decodes it as 2^128 (x * 2^128: +-2^127
// for +-0.5, +-inf for the rest, 0 stays 0), weights no training can use; the released checkpoints have none.
inline constexpr uint8_t kE8m0Nan = 255;

// The names a checkpoint gives the pair of a tensor `name` ("...experts.gate_up_proj" -> "..._blocks" / "..._scales").
std::string mxfp4_blocks_name(const std::string& name);
std::string mxfp4_scales_name(const std::string& name);

// Why a tensor that decodes to `decoded` cannot be MXFP4-packed ("" when it can): it needs at least 1 dim (2 when
// `transposed`) and a packed dim (the last; the second to last when `transposed`) that is a multiple of 32.
std::string mxfp4_packing_problem(const Shape& decoded, bool transposed);
// The shape of X_blocks of a tensor that decodes to `decoded` (f32 [..., C], C a multiple of 32): [..., C / 32, 16];
// `transposed` (see dequantize_mxfp4_transposed): `decoded` is [..., C, R] and the blocks [..., R, C / 32, 16].
// X_scales has this shape without its last dim. An error naming `what` when it cannot be packed.
Shape mxfp4_blocks_shape(const Shape& decoded, bool transposed, const std::string& what);

// The index (in row-major order) of the first scale byte equal to kE8m0Nan in `scales` (u8, CPU, contiguous), -1 when
// there is none.
int64_t mxfp4_first_nan_scale(const Tensor& scales);
// "" when `scales` holds no kE8m0Nan, else what the decoder refuses: "scale [1, 2, 3] is 255, e8m0's NaN: refused ...".
std::string mxfp4_nan_scale_problem(const Tensor& scales);

// Decodes blocks (u8 [..., G, 16]) and scales (u8 [..., G], the same leading dims) into f32 [..., G * 32]: within a
// block, byte j holds value 2j in its low nibble and value 2j + 1 in its high nibble; nibble n is the e2m1 value
// {0, .5, 1, 1.5, 2, 3, 4, 6}[n & 7], negative when n & 8 (8 is -0); the block's values are multiplied by
// 2^(scale - 127). Every result is exact (at most 2 significant bits); |value| >= 2^128 is +-inf, as transformers
// gives it. Both tensors on the CPU and contiguous; a scale byte of 255 (e8m0 NaN) is refused, naming its position.
// Its bf16 rounding is transformers' default (bf16) result bit for bit: f32 and bf16 share the exponent range.
Tensor dequantize_mxfp4(const Tensor& blocks, const Tensor& scales);

// The same with the last two dims swapped, the layout transformers hands GPT-OSS (convert_moe_packed_tensors ends
// with transpose(1, 2) of its [E, R, C] result): blocks [..., R, G, 16] and scales [..., R, G] give f32
// [..., G * 32, R], e.g. gate_up_proj_blocks [E, 2I, H / 32, 16] -> gate_up_proj [E, H, 2I]. Written straight into
// the transposed layout (one output tensor, no intermediate). Blocks need at least 3 dims. (transformers swaps dims
// 1 and 2, which are the last two for the 4-D blocks it is given.)
Tensor dequantize_mxfp4_transposed(const Tensor& blocks, const Tensor& scales);

}  // namespace moetrain::io
