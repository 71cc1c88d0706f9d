// defines: the CUDA decoding attention (ops/cuda/attention_decode.h): one warp per (sequence, head) repeating the
// training forward's per-row arithmetic (attention_row.cuh) for the sequence's newest token.
#include "ops/cuda/attention_decode.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/cuda/attention_mma.h"
#include "ops/cuda/attention_row.cuh"
#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

using attention_row::kFullMask;
using attention_row::kKeysPerLane;
using attention_row::kKeyTile;

constexpr int kWarps = 4;  // warps per block, each its own (sequence, head)
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxHeadDim = 256;  // the training forward's limit (ops/cuda/attention.cu)

// Row b of q at position i = lengths[b] - 1 of a document starting at cache row 0, exactly as forward_kernel computes
// that row: key tiles of 64 aligned to the document's start, from the tile holding the row's first visible key to
// the one holding i; per tile the scores of the lane's two keys (k0 + lane, k0 + lane + 32) as one fused chain over
// ascending d, update_row, then acc += p_j v_j over the tile's keys in ascending order. forward_kernel's tiles before
// the row's first visible one leave it unchanged (m = -inf, l = 0, acc = +0 and acc + 0 v = +0), so they are skipped.
// The lane's columns are lane + 32 c (c < kChunks); kSpan elements of a key row are read at a time (8: 16-byte
// loads, when hd is a multiple of 8 and k_cache is 16-byte aligned), which changes no arithmetic.
template <typename T, int kChunks, int kSpan>
__global__ void __launch_bounds__(kThreads)
    decode_kernel(T* out, float* lse, const T* q, const T* k_cache, const T* v_cache, const int32_t* lengths,
                  int64_t pairs, int nh, int nkv, int hd, int hdv, int64_t capacity, float scale, int window) {
  __shared__ float q_s[kWarps][kMaxHeadDim];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (pair >= pairs) return;  // the whole warp: nothing below synchronizes more than a warp
  const int64_t b = pair / nh;
  const int h = static_cast<int>(pair % nh), g = h / (nh / nkv);
  const int i = lengths[b] - 1;
  const int kb = window > 0 ? max(0, i - window + 1) : 0, ke = i + 1;  // keys [kb, ke): key_begin / key_end

  float* q_row = q_s[warp];
  for (int d = lane; d < hd; d += 32) q_row[d] = attention_row::to_f32(q[pair * hd + d]);
  __syncwarp();
  const int64_t k_stride = static_cast<int64_t>(nkv) * hd, v_stride = static_cast<int64_t>(nkv) * hdv;
  const T* k_base = k_cache + b * capacity * k_stride + static_cast<int64_t>(g) * hd;
  const T* v_base = v_cache + b * capacity * v_stride + static_cast<int64_t>(g) * hdv;

  float m = -INFINITY, l = 0.0f, acc[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) acc[c] = 0.0f;
  for (int k0 = kb / kKeyTile * kKeyTile; k0 < ke; k0 += kKeyTile) {
    const int nk = min(kKeyTile, ke - k0);
    // Scores of keys the row does not see are masked by update_row (and their cache rows may lie past the length),
    // so they are not computed.
    float s[kKeysPerLane] = {};
#pragma unroll
    for (int kk = 0; kk < kKeysPerLane; ++kk) {
      const int j = k0 + lane + 32 * kk;
      if (j < kb || j >= ke) continue;
      const T* k_row = k_base + j * k_stride;
      for (int d = 0; d < hd; d += kSpan) {
        float kv[kSpan];
        load_span<kSpan>(k_row + d, kv);
#pragma unroll
        for (int e = 0; e < kSpan; ++e) s[kk] = attention_row::score_step(q_row[d + e], kv[e], s[kk]);
      }
    }

    float p[kKeysPerLane];
    attention_row::update_row(s, k0, lane, kb, ke, scale, m, l, acc, p);

    // The tile's keys in ascending order, key k0 + 32 kk + t's probability from lane t.
#pragma unroll
    for (int kk = 0; kk < kKeysPerLane; ++kk) {
      const int count = min(32, nk - 32 * kk);
      for (int t = 0; t < count; ++t) {
        const float pj = __shfl_sync(kFullMask, p[kk], t);
        const T* v_row = v_base + (k0 + 32 * kk + t) * v_stride;
        float vv[kChunks];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) vv[c] = lane + 32 * c < hdv ? load_float(v_row + lane + 32 * c) : 0.0f;
        attention_row::add_value(pj, vv, acc);
      }
    }
  }
  attention_row::write_row(out + pair * hdv, lse + pair, acc, m, l, lane, hdv);
}

template <typename T, int kChunks, int kSpan>
void launch(cudaStream_t stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k_cache,
            const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params) {
  const int64_t pairs = q.size(0) * q.size(1);
  decode_kernel<T, kChunks, kSpan><<<static_cast<unsigned>((pairs + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
      static_cast<T*>(out.raw_data()), static_cast<float*>(lse.raw_data()), static_cast<const T*>(q.raw_data()),
      static_cast<const T*>(k_cache.raw_data()), static_cast<const T*>(v_cache.raw_data()),
      static_cast<const int32_t*>(lengths.raw_data()), pairs, static_cast<int>(q.size(1)),
      static_cast<int>(k_cache.size(2)), static_cast<int>(q.size(2)), static_cast<int>(v_cache.size(3)),
      k_cache.size(1), params.softmax_scale, params.sliding_window);
  MT_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_typed(cudaStream_t stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k_cache,
                  const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params) {
  const int64_t hd = q.size(2), hdv = v_cache.size(3);
  const bool wide = hdv > 128, spans = spans_of_8(hd, {k_cache.raw_data()});
  if (wide) {
    spans ? launch<T, 8, 8>(stream, out, lse, q, k_cache, v_cache, lengths, params)
          : launch<T, 8, 1>(stream, out, lse, q, k_cache, v_cache, lengths, params);
  } else {
    spans ? launch<T, 4, 8>(stream, out, lse, q, k_cache, v_cache, lengths, params)
          : launch<T, 4, 1>(stream, out, lse, q, k_cache, v_cache, lengths, params);
  }
}

}  // namespace

void attention_decode_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                              const AttentionParams& params) {
  constexpr const char* op = "attention_decode_forward (CUDA)";
  const int64_t nh = q.size(1), hd = q.size(2), capacity = k_cache.size(1), hdv = v_cache.size(3);
  MT_CHECK(hd >= 1 && hd <= kMaxHeadDim && hdv >= 1 && hdv <= kMaxHeadDim,
           "{}: the CUDA kernel takes head dims in [1, {}] (those of the training forward) but found hd = {} (q, "
           "k_cache) and hdv = {} (v_cache)",
           op, kMaxHeadDim, hd, hdv);
  // Key indices are ints, as in the training forward (offsets are 64-bit).
  MT_CHECK(capacity <= (int64_t{1} << 30) && nh <= (int64_t{1} << 30),
           "{}: the CUDA kernel takes at most 2^30 cached rows and heads but found C = {}, nh = {}", op, capacity, nh);
  // The cases the training forward runs on the tensor-core kernels decode through their device code.
  if (mma_attention_supported(q.dtype(), hd, hdv)) {
    mma_attention_decode_forward(stream, out, lse, q, k_cache, v_cache, lengths, params);
    return;
  }
  const auto cs = static_cast<cudaStream_t>(stream_handle(stream));
  switch (q.dtype()) {
    case DType::F32: launch_typed<float>(cs, out, lse, q, k_cache, v_cache, lengths, params); break;
    case DType::BF16: launch_typed<__nv_bfloat16>(cs, out, lse, q, k_cache, v_cache, lengths, params); break;
    default: MT_FAIL("{}: expected q in f32 or bf16 but found {}", op, q.describe());
  }
}

}  // namespace moetrain::ops::cuda
