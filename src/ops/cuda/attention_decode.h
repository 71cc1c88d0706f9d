// defines: the CUDA kernel of generation's attention step (ops::attention_decode_forward): each sequence's newest
// token over its cached keys and values.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/attention.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::attention_decode_forward: q [B, nh, hd], k_cache [B, C, nkv, hd], v_cache [B, C, nkv,
// hdv], out [B, nh, hdv] in f32 or bf16 (computed in f32), lse [B, nh] f32, lengths i32 [B] on the device (values in
// [1, C], checked on the host copy); here also hd, hdv in [1, 256]. One warp per (sequence, head), the per-row
// arithmetic of the training forward (ops/cuda/attention.cu, attention_row.cuh) over the same key tiles, so out and
// lse equal, bit for bit, that forward's row for the token at position lengths[b] - 1 of a document whose keys and
// values are the cache rows 0 .. lengths[b] - 1. Deterministic; no scratch.
void attention_decode_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                              const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
                              const AttentionParams& params);

}  // namespace moetrain::ops::cuda
