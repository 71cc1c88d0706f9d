// defines: HfPiece, one Hugging Face tensor inside an internal parameter, and the two moves between them. A piece
// lands in the internal tensor through a strided map: the HF tensor's elements, read in row-major order as
// `view_shape`, go to internal element offset + sum(index[d] * strides[d]). One map expresses every transform a
// family's checkpoint needs: stacking experts (offset), slicing (offset and a smaller view), transposing (swapped
// strides) and de-interleaving columns (a last dimension split in two, e.g. [H, 2I] read as [H, I, 2] with the pair
// dimension striding by I * H). Contiguous pieces (the common case) leave view_shape and strides empty.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/tensor.h"

namespace moetrain::model {

struct HfPiece {
  std::string hf_name;
  Shape hf_shape;
  int64_t offset = 0;  // internal element of the piece's first element
  // Empty: the piece is the contiguous block [offset, offset + numel) of the internal tensor, in hf_shape.
  Shape view_shape;
  std::vector<int64_t> strides;  // internal elements per step of each view dimension
  // When the checkpoint gives the piece as an MXFP4 pair (hf_name + "_blocks" / "_scales", io/mxfp4.h) instead of
  // hf_name: whether its packed layout has hf_shape's last two dims swapped. GPT-OSS's experts set it: transformers
  // decodes gate_up_proj_blocks [E, 2I, H / 32, 16] and transposes the result into the gate_up_proj [E, H, 2I] it
  // holds (down_proj alike: [E, H, I / 32, 16] -> [E, I, H]). False: the blocks run along hf_shape's last dim
  // ([..., C] from [..., C / 32, 16]). Only loading reads it; a piece given whole ignores it.
  bool mxfp4_transposed = false;

  int64_t numel() const { return shape_numel(hf_shape); }
  bool contiguous() const { return strides.empty(); }
  // The internal elements the piece spans, [first, last] (for bounds checks).
  int64_t last_element() const;
};

// A piece with its map: `view_shape` must hold hf_shape's elements; strides one per view dimension.
HfPiece strided_piece(std::string hf_name, Shape hf_shape, int64_t offset, Shape view_shape,
                      std::vector<int64_t> strides);

// Checks that the pieces cover the internal tensor of `shape` exactly once (every element, no overlap); `what` names
// the parameter in errors.
void check_pieces_tile(const std::vector<HfPiece>& pieces, const Shape& shape, const std::string& what);

// The HF tensor of `piece` (f32, contiguous, on the CPU) out of the internal tensor `whole` (f32, on the CPU).
Tensor extract_piece(const Tensor& whole, const HfPiece& piece);
// Writes the HF tensor `value` (any float dtype, on the CPU, hf_shape) into `whole` (f32, contiguous, CPU).
void place_piece(Tensor& whole, const HfPiece& piece, const Tensor& value);

// [hf_name, hf_shape, offset] or, for a strided piece, [hf_name, hf_shape, offset, view_shape, strides], followed by
// {"mxfp4_transposed": true} when the piece sets it: how checkpoints record a layout that can be read without the
// model (train/checkpoint.h).
nlohmann::json piece_to_json(const HfPiece& piece);
// The inverse; `source` names the file in errors.
HfPiece piece_from_json(const nlohmann::json& entry, const std::string& source);

}  // namespace moetrain::model
