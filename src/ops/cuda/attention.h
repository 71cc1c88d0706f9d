// defines: the CUDA kernels' launchers for causal grouped-query attention over packed documents
// (ops/attention.h): a flash-attention style forward and a deterministic backward without atomics.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "ops/attention.h"

namespace moetrain::ops::cuda {

// The arguments are validated by ops::attention_forward / ops::attention_backward: q, k, v, out (and dout, dq, dk,
// dv) in f32 or bf16 (one dtype), lse f32 [T, nh], cu_seqlens i32 [D + 1] on the same device. cu_seqlens' values
// are the caller's contract (0 = c0 < c1 < ... < cD = T; validate_cu_seqlens on the host copy): the kernels read
// them on the device and cannot report a bad one. hd and hdv must be at most 256 (checked here; past 128 the tiles
// hold half the rows).
//
// Work split: the queries (forward, dq) or keys (dk, dv) of every document are cut into tiles that start at the
// document's first token, one thread block per (tile, head); a block finds its document by a binary search in
// cu_seqlens. Every output element is reduced by one thread in ascending token order (and, for dk / dv, ascending
// query head of the kv group), and the forward's online-softmax key tiles are aligned to the document start, so a
// document's results are bitwise independent of what else is packed into the micro-batch.
void attention_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params);
// dq, dk, dv are overwritten. Uses a scratch f32 [T, nh] (the row terms dot(dout_i, out_i)) from the device pool.
void attention_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params);

}  // namespace moetrain::ops::cuda
