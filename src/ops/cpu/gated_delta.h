// defines: the CPU reference of the Gated DeltaNet ops (ops/gated_delta.h): plain loops in f32 or f64, every sum in
// one thread in ascending order, so the results do not depend on the thread count.
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// Arguments validated by the ops:: functions of ops/gated_delta.h: one float dtype, contiguous, cu_seqlens valid.
void causal_conv1d_silu_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens);
void causal_conv1d_silu_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                                 const Tensor& cu_seqlens);
void l2norm_forward(const Tensor& y, const Tensor& x, float eps);
void l2norm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, float eps);
void gated_delta_gates_forward(const Tensor& g, const Tensor& beta, const Tensor& a, const Tensor& b,
                               const Tensor& A_log, const Tensor& dt_bias);
void gated_delta_gates_backward(const Tensor& da, const Tensor& db, const Tensor& dA_log, const Tensor& ddt_bias,
                                const Tensor& dg, const Tensor& dbeta, const Tensor& a, const Tensor& b,
                                const Tensor& A_log, const Tensor& dt_bias);
// The recurrence of ops::gated_delta_rule_forward, one (document, value head) per task; final_state (undefined: not
// kept) [D, Hv, dk, dv] receives each one's last state (ops::gated_delta_rule_prefill).
void gated_delta_rule_forward(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, const Tensor& cu_seqlens, float scale,
                              const Tensor& final_state = Tensor());
// ops::gated_delta_rule_decode and ops::causal_conv1d_silu_decode: the forward's per-token code on one token per
// sequence.
void gated_delta_rule_decode(const Tensor& out, const Tensor& state, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& g, const Tensor& beta, float scale);
void causal_conv1d_silu_decode(const Tensor& y, const Tensor& history, const Tensor& w, const Tensor& lengths);
// The reverse scan. The states it needs are recomputed from the forward: the state before every chunk of
// kGatedDeltaCheckpoint tokens is kept, and each chunk's states are recomputed from it, so the memory is
// (len / kGatedDeltaCheckpoint + kGatedDeltaCheckpoint) states per task, not len.
void gated_delta_rule_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dg,
                               const Tensor& dbeta, const Tensor& dout, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                               float scale);
void gated_rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& z, const Tensor& w,
                           float eps);
void gated_rmsnorm_backward(const Tensor& dx, const Tensor& dz, const Tensor& dw, const Tensor& dy, const Tensor& x,
                            const Tensor& z, const Tensor& w, const Tensor& rstd, float eps);

inline constexpr int64_t kGatedDeltaCheckpoint = 64;

}  // namespace moetrain::ops::cpu
