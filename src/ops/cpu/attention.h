// defines: the CPU reference of causal grouped-query attention over packed documents (ops/attention.h): a direct
// masked softmax per (query token, head), and a backward that recomputes the probabilities from the saved lse.
#pragma once

#include "core/tensor.h"
#include "ops/attention.h"

namespace moetrain::ops::cpu {

// The arguments are validated by ops::attention_forward / ops::attention_backward; f32 or f64.
// Visibility: key j of query i's document is seen when j <= i (causal) and i - j < sliding_window
// (when > 0); without causal masking the window is symmetric, |i - j| < sliding_window.
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, const AttentionParams& params);
void attention_decode_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params);
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params);

}  // namespace moetrain::ops::cpu
