// defines: the LM head fused with the cross-entropy, chunked over the vocabulary: logits = x W^T are produced
// C columns at a time into one reused [T, C] scratch and never held whole. The forward keeps a running max /
// sum-exp / target logit per row; with the loss scale known up front, a second pass over the chunks also produces
// the gradients at once (as Liger's fused linear cross-entropy does), so no [T, V] tensor exists in either pass.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/loss.h"

namespace moetrain::ops {

// Default chunk width (vocabulary columns per GEMM): [T, 8192] bf16 is 128 MiB at T = 8192.
constexpr int64_t kLinearCrossEntropyChunk = 8192;

// losses [T] = lse - logit[t, target] (0 where target == ignore_index) and lse [T] of logits = x [T, K] * w [V, K]^T,
// the same values as linear_forward + cross_entropy_forward (ops/loss.h) up to rounding (the lse is merged over
// the chunks online). CPU: x, w, losses, lse all f32 or all f64. CUDA: x, w both f32 or both bf16 (the logits
// chunk is in their dtype, as the unfused path's logits are), losses / lse f32. chunk > 0 columns per GEMM.
void linear_cross_entropy_forward(Stream& stream, Tensor losses, Tensor lse, const Tensor& x, const Tensor& w,
                                  const Tensor& targets, int64_t chunk = kLinearCrossEntropyChunk,
                                  int ignore_index = kIgnoreIndex);

// The forward above plus the gradients of loss = scale * sum_t losses[t]: dx [T, K] (x's dtype) is overwritten
// with d loss / dx, dw [V, K] (CPU: x's dtype; CUDA: f32) accumulates d loss / dw (+=, so micro-batches sum into
// one gradient). Rows whose target is ignored contribute nothing. Two passes over the chunks: the first computes
// the row statistics, the second recomputes each chunk's logits (except the last chunk's, still in the scratch),
// turns them in place into dlogits_c = scale * (softmax - onehot) and runs dx += dlogits_c W_c (f32 accumulator;
// on CUDA bf16 a separate f32 [T, K] buffer rounded to bf16 once at the end) and dw_c += dlogits_c^T x. Cost:
// 2 T V K (4 - 1/chunks) FLOPs against 6 T V K for the unfused path: one extra logits GEMM but no [T, V] tensors.
// Deterministic: the chunk sequence depends on V and chunk only (the second pass walks it from the last chunk down).
void linear_cross_entropy_forward_backward(Stream& stream, Tensor losses, Tensor lse, Tensor dx, Tensor dw,
                                           const Tensor& x, const Tensor& w, const Tensor& targets, double scale,
                                           int64_t chunk = kLinearCrossEntropyChunk, int ignore_index = kIgnoreIndex);

}  // namespace moetrain::ops
