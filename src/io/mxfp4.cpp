// defines: the MXFP4 decoder (io/mxfp4.h): argument checks, then one pass over the blocks, parallel over
// independent output slices (each element is written once, by one thread: the result does not depend on the threads).
#include "io/mxfp4.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::io {

namespace {

// Below this many blocks one thread decodes (starting the team costs more than the work).
constexpr int64_t kParallelBlocks = 1 << 12;

// e2m1: transformers' FP4_VALUES, indexed by the nibble (bit 3 the sign).
constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// The 16 values of a block under scale byte `scale` (< 255): FP4 value * 2^(scale - 127). 2^(scale - 127) lies in
// [2^-127, 2^127], an f32 (2^-127 a subnormal); the product has at most 2 significant bits, so it is exact down to
// 0.5 * 2^-127 and overflows to +-inf from 2^128 on, as transformers' ldexp does.
void block_values(uint8_t scale, float values[16]) {
  const float factor = std::ldexp(1.0f, static_cast<int>(scale) - 127);
  for (int n = 0; n < 16; ++n) values[n] = kFp4Values[n] * factor;
}

std::string index_str(int64_t flat, const Shape& shape) {
  std::vector<int64_t> index(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return fmt::format("[{}]", fmt::join(index, ", "));
}

void check_pair(const Tensor& blocks, const Tensor& scales, bool transposed) {
  const char* op = transposed ? "dequantize_mxfp4_transposed" : "dequantize_mxfp4";
  MT_CHECK(blocks.dtype() == DType::U8, "{}: blocks are {} but u8 (two fp4 values a byte) was expected", op,
           blocks.describe());
  MT_CHECK(scales.dtype() == DType::U8, "{}: scales are {} but u8 (e8m0 exponents) was expected", op,
           scales.describe());
  MT_CHECK(blocks.device().is_cpu() && scales.device().is_cpu(), "{}: blocks ({}) and scales ({}) must be on the CPU",
           op, blocks.describe(), scales.describe());
  MT_CHECK(blocks.is_contiguous() && scales.is_contiguous(), "{}: blocks ({}) and scales ({}) must be contiguous", op,
           blocks.describe(), scales.describe());
  const int min_dims = transposed ? 3 : 2;
  MT_CHECK(blocks.dim() >= min_dims && blocks.shape().back() == kMxfp4BlockBytes,
           "{}: blocks are {} but [{}G, {}] was expected (16 bytes, 32 fp4 values, per block)", op, blocks.describe(),
           transposed ? "..., R, " : "..., ", kMxfp4BlockBytes);
  const Shape expected(blocks.shape().begin(), blocks.shape().end() - 1);
  MT_CHECK(scales.shape() == expected,
           "{}: scales are {} but blocks {} need scales of shape {} (one per block: the blocks' dims but the last)", op,
           scales.describe(), blocks.describe(), shape_str(expected));
  const std::string nan = mxfp4_nan_scale_problem(scales);
  MT_CHECK(nan.empty(), "{}: {}", op, nan);
}

}  // namespace

std::string mxfp4_blocks_name(const std::string& name) { return name + "_blocks"; }
std::string mxfp4_scales_name(const std::string& name) { return name + "_scales"; }

std::string mxfp4_packing_problem(const Shape& decoded, bool transposed) {
  const size_t min_dims = transposed ? 2 : 1;
  if (decoded.size() < min_dims)
    return fmt::format("at least {} dim(s) expected{}", min_dims, transposed ? " (its last two are swapped)" : "");
  const int64_t packed = decoded[decoded.size() - min_dims];
  if (packed % kMxfp4BlockValues != 0)
    return fmt::format("its packed dim ({}) is not a multiple of {}", packed, kMxfp4BlockValues);
  return "";
}

Shape mxfp4_blocks_shape(const Shape& decoded, bool transposed, const std::string& what) {
  const std::string problem = mxfp4_packing_problem(decoded, transposed);
  MT_CHECK(problem.empty(), "'{}' of shape {} cannot be MXFP4-packed: {}", what, shape_str(decoded), problem);
  Shape blocks = decoded;
  const int64_t packed = decoded[decoded.size() - (transposed ? 2 : 1)];
  blocks.pop_back();
  if (transposed) blocks.back() = decoded.back();  // decoded [..., C, R] -> [..., R]
  blocks.push_back(packed / kMxfp4BlockValues);
  blocks.push_back(kMxfp4BlockBytes);
  return blocks;
}

int64_t mxfp4_first_nan_scale(const Tensor& scales) {
  MT_CHECK(scales.dtype() == DType::U8 && scales.device().is_cpu() && scales.is_contiguous(),
           "mxfp4: scales are {} but contiguous u8 on the CPU was expected", scales.describe());
  const uint8_t* s = scales.data<uint8_t>();
  const void* hit = std::memchr(s, kE8m0Nan, static_cast<size_t>(scales.numel()));  // GB of scales for 120B: fast
  return hit == nullptr ? -1 : static_cast<const uint8_t*>(hit) - s;
}

std::string mxfp4_nan_scale_problem(const Tensor& scales) {
  const int64_t at = mxfp4_first_nan_scale(scales);
  if (at < 0) return "";
  return fmt::format(
      "scale {} is 255, e8m0's NaN: refused (transformers would decode its block as 2^128 times the fp4 values: "
      "+-2^127 and infinite weights)",
      index_str(at, scales.shape()));
}

Tensor dequantize_mxfp4(const Tensor& blocks, const Tensor& scales) {
  check_pair(blocks, scales, /*transposed=*/false);
  Shape shape = scales.shape();
  shape.back() *= kMxfp4BlockValues;
  Tensor out = Tensor::empty(shape, DType::F32);
  const uint8_t* b = blocks.data<uint8_t>();
  const uint8_t* s = scales.data<uint8_t>();
  float* o = out.data<float>();
  const int64_t count = scales.numel();
#pragma omp parallel for schedule(static) num_threads(omp_get_num_procs()) if (count > kParallelBlocks)
  for (int64_t k = 0; k < count; ++k) {
    float values[16];
    block_values(s[k], values);
    const uint8_t* in = b + k * kMxfp4BlockBytes;
    float* dst = o + k * kMxfp4BlockValues;
    for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) {
      dst[2 * j] = values[in[j] & 0x0F];  // low nibble first
      dst[2 * j + 1] = values[in[j] >> 4];
    }
  }
  return out;
}

Tensor dequantize_mxfp4_transposed(const Tensor& blocks, const Tensor& scales) {
  check_pair(blocks, scales, /*transposed=*/true);
  const Shape& sshape = scales.shape();  // [..., R, G]
  const int64_t rows = sshape[sshape.size() - 2], groups = sshape.back();
  const int64_t cols = groups * kMxfp4BlockValues;
  Shape shape(sshape.begin(), sshape.end() - 2);
  const int64_t slabs = shape_numel(shape);  // the leading dims, flattened
  shape.push_back(cols);
  shape.push_back(rows);
  Tensor out = Tensor::empty(shape, DType::F32);
  const uint8_t* b = blocks.data<uint8_t>();
  const uint8_t* s = scales.data<uint8_t>();
  float* o = out.data<float>();
  // Task (slab, group) writes output rows [group * 32, group * 32 + 32) of its slab, sweeping r: 32 sequential
  // output streams, each element written once.
#pragma omp parallel for schedule(static) num_threads(omp_get_num_procs()) if (scales.numel() > kParallelBlocks)
  for (int64_t task = 0; task < slabs * groups; ++task) {
    const int64_t slab = task / groups, g = task % groups;
    float* dst = o + (slab * cols + g * kMxfp4BlockValues) * rows;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t k = (slab * rows + r) * groups + g;  // the block (slab, r, g)
      float values[16];
      block_values(s[k], values);
      const uint8_t* in = b + k * kMxfp4BlockBytes;
      for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) {
        dst[(2 * j) * rows + r] = values[in[j] & 0x0F];
        dst[(2 * j + 1) * rows + r] = values[in[j] >> 4];
      }
    }
  }
  return out;
}

}  // namespace moetrain::io
