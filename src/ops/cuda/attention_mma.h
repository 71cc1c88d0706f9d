// defines: the tensor-core (mma.sync m16n8k16, bf16) attention kernels' launchers: the forward, the deterministic
// backward and the decoding step for the head dims they take, with the properties of ops/cuda/attention.h.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "ops/attention.h"

namespace moetrain::ops::cuda {

// Whether the tensor-core kernels take these arguments: bf16 with hd == hdv in {64, 128}. Every other case runs on
// the CUDA-core kernels (ops/cuda/attention.cu, attention_decode.cu).
bool mma_attention_supported(DType dtype, int64_t hd, int64_t hdv);

// The arguments of ops/cuda/attention.h's attention_forward / attention_backward (already validated there), for the
// cases mma_attention_supported takes. Tiles of 64 queries (forward, dq) or keys (dk, dv) start at each document's
// first token; each warp owns 16 rows of a tile and reduces every output element in a fixed order (head dim in
// ascending 16-wide mma steps, key tiles of 64 ascending from the document start, for dk / dv query heads then query
// tiles ascending), so a row's bytes depend only on its document and its position there. No atomics.
void mma_attention_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params);
void mma_attention_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                            const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const Tensor& lse, const Tensor& cu_seqlens, const AttentionParams& params);

// The decoding step (ops/cuda/attention_decode.h's arguments) for the cases mma_attention_supported takes: the query
// heads of one kv head in the rows of a 16-row mma tile, run through the forward's per-tile device code over the same
// key tiles, so out and lse equal the forward's rows bit for bit.
void mma_attention_decode_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                                  const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                                  const AttentionParams& params);

}  // namespace moetrain::ops::cuda
