// defines: the CUDA rope kernel. One thread per (token, pair), over the token's heads: the pair (a, b) becomes
// (a*c - b*s, b*c + a*s) with c = cos * scaling and s = sin * scaling (the backward, the transpose, negates s), as
// ops/cpu/rope.cpp; threads past the pairs copy the heads' dims outside the rotation (none in place).
#include "ops/cuda/rope.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/rope_pairs.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond this

// Passed by value in the kernel's parameter space (about 1 KiB).
struct RopeArgs {
  float inv_freq[kRopeMaxFrequencies];
  int64_t tokens;
  int64_t heads;
  int64_t head_dim;
  int64_t half;    // rotary_dim / 2
  int64_t first;   // first_rotated_dim
  int64_t work;    // items per (token, head): half pairs + (head_dim - rotary_dim) copied dims (none in place)
  float scaling;   // attention_scaling
  float sin_sign;  // +1 forward, -1 backward
  bool interleaved;
};

// One thread per (token, item): the angle's cos and sin once, then the item in every head of the token (adjacent
// threads take adjacent items of a head: the accesses coalesce).
template <typename T>
__global__ void rope_kernel(T* out, const T* in, const int32_t* position_ids, const RopeArgs args) {
  const int64_t total = args.tokens * args.work;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t token = idx / args.work;
    const int64_t j = idx % args.work;
    const T* x = in + token * args.heads * args.head_dim;
    T* y = out + token * args.heads * args.head_dim;
    if (j >= args.half) {  // the dims outside [first, first + rotary_dim)
      const int64_t copied = j - args.half;
      const int64_t d = copied < args.first ? copied : copied + 2 * args.half;
      for (int64_t h = 0; h < args.heads; ++h)
        store_float(y + h * args.head_dim + d, load_float(x + h * args.head_dim + d));
      continue;
    }
    float c, s;
    rope_cos_sin(position_ids[token], args.inv_freq[j], args.scaling, &c, &s);
    s *= args.sin_sign;  // exact
    // rotate_half pairs (j, j + half); interleaved pairs (2j, 2j + 1).
    const int64_t ia = args.first + (args.interleaved ? 2 * j : j);
    const int64_t ib = args.first + (args.interleaved ? 2 * j + 1 : j + args.half);
    for (int64_t h = 0; h < args.heads; ++h) {
      const int64_t base = h * args.head_dim;
      const float a = load_float(x + base + ia);
      const float b = load_float(x + base + ib);
      store_float(y + base + ia, rotated_first(a, b, c, s));
      store_float(y + base + ib, rotated_second(a, b, c, s));
    }
  }
}

// One thread per (token, pair): table[0][token][j] = c, table[1][token][j] = s, as rope_kernel computes them.
__global__ void cos_sin_table_kernel(float* table, const int32_t* position_ids, const RopeArgs args) {
  const int64_t total = args.tokens * args.half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t token = idx / args.half;
    rope_cos_sin(position_ids[token], args.inv_freq[idx % args.half], args.scaling, table + idx, table + total + idx);
  }
}

unsigned blocks_for(int64_t total) {
  const int64_t blocks64 = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks64 < kMaxBlocks ? blocks64 : kMaxBlocks);
}

// The kernel arguments of `params` over `tokens` tokens of `heads` heads of head_dim (validated by ops::rope_*);
// copy_unrotated: the dims outside the rotation are copied too (out of place; in place they already hold them).
RopeArgs rope_args(const RopeParams& params, int64_t tokens, int64_t heads, int64_t head_dim, float sin_sign,
                   bool copy_unrotated, const char* op) {
  const int64_t half = params.rotary_dim / 2;
  MT_CHECK(half <= kRopeMaxFrequencies && static_cast<int64_t>(params.inv_freq.size()) == half,
           "{} (CUDA): expected rotary_dim / 2 = {} inv_freq values, at most {}, but found {}", op, half,
           kRopeMaxFrequencies, params.inv_freq.size());
  RopeArgs args{};
  for (int64_t i = 0; i < half; ++i) args.inv_freq[i] = params.inv_freq[static_cast<size_t>(i)];
  args.tokens = tokens;
  args.heads = heads;
  args.head_dim = head_dim;
  args.half = half;
  args.first = params.first_rotated_dim;
  args.work = half + (copy_unrotated ? head_dim - params.rotary_dim : 0);
  args.scaling = params.attention_scaling;
  args.sin_sign = sin_sign;
  args.interleaved = params.interleaved;
  return args;
}

void run(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& position_ids,
         const RopeParams& params, float sin_sign, const char* op) {
  const RopeArgs args = rope_args(params, in.size(0), in.size(1), in.size(2), sin_sign,
                                  /*copy_unrotated=*/out.raw_data() != in.raw_data(), op);
  const int64_t total = args.tokens * args.work;
  if (total == 0 || args.heads == 0) return;
  const unsigned blocks = blocks_for(total);
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const auto* positions = static_cast<const int32_t*>(position_ids.raw_data());
  switch (in.dtype()) {
    case DType::F32:
      rope_kernel<<<blocks, kThreads, 0, cu_stream>>>(static_cast<float*>(out.raw_data()),
                                                      static_cast<const float*>(in.raw_data()), positions, args);
      break;
    case DType::BF16:
      rope_kernel<<<blocks, kThreads, 0, cu_stream>>>(static_cast<__nv_bfloat16*>(out.raw_data()),
                                                      static_cast<const __nv_bfloat16*>(in.raw_data()), positions,
                                                      args);
      break;
    default: MT_FAIL("{} (CUDA): expected f32 or bf16 but found {}", op, in.describe());
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void rope_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& position_ids,
                  const RopeParams& params) {
  run(stream, y, x, position_ids, params, 1.0f, "rope_forward");
}

void rope_backward(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& position_ids,
                   const RopeParams& params) {
  run(stream, dx, dy, position_ids, params, -1.0f, "rope_backward");
}

void rope_cos_sin_table(const Stream& stream, const Tensor& table, const Tensor& position_ids,
                        const RopeParams& params) {
  const int64_t tokens = position_ids.numel();
  const RopeArgs args =
      rope_args(params, tokens, 1, params.rotary_dim, 1.0f, /*copy_unrotated=*/false, "rope_cos_sin_table");
  MT_CHECK(table.dtype() == DType::F32 && table.numel() == 2 * tokens * args.half,
           "rope_cos_sin_table (CUDA): expected an f32 table of [2, {}, {}] but found {}", tokens, args.half,
           table.describe());
  if (tokens * args.half == 0) return;
  cos_sin_table_kernel<<<blocks_for(tokens * args.half), kThreads, 0,
                         static_cast<cudaStream_t>(stream_handle(stream))>>>(
      static_cast<float*>(table.raw_data()), static_cast<const int32_t*>(position_ids.raw_data()), args);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
