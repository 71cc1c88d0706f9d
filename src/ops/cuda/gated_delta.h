// defines: the CUDA kernels of the Gated DeltaNet ops (ops/gated_delta.h), the simple form: elementwise and one warp
// per row for the conv, the norms and the gates; the rule as a sequential scan per (document, value head) with the
// dk x dv state in registers, kept beside the chunked kernels the op runs (ops/cuda/gated_delta_chunked.h) as their
// GPU cross-check at shapes too large for the CPU reference and as the benchmark's baseline. Deterministic: every
// sum in an order fixed by the shapes, no float atomics.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by the ops:: functions: contiguous, on the stream's device; activations f32 or bf16 (computed in
// f32), g, beta, rstd, the 1-D weights and every weight gradient f32, the conv's w f32 or bf16; cu_seqlens i32 on the
// device with valid values (the caller's contract). Weight gradients (dw, dA_log, ddt_bias) sum fixed chunks of rows
// in ascending order, then the chunks in ascending order.
void causal_conv1d_silu_forward(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w,
                                const Tensor& cu_seqlens);
// Generation's conv step (ops::causal_conv1d_silu_decode): lengths i32 [B] on the device.
void causal_conv1d_silu_decode(const Stream& stream, const Tensor& y, const Tensor& history, const Tensor& w,
                               const Tensor& lengths);
void causal_conv1d_silu_backward(const Stream& stream, const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                 const Tensor& x, const Tensor& w, const Tensor& cu_seqlens);
void l2norm_forward(const Stream& stream, const Tensor& y, const Tensor& x, float eps);
void l2norm_backward(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& x, float eps);
void gated_delta_gates_forward(const Stream& stream, const Tensor& g, const Tensor& beta, const Tensor& a,
                               const Tensor& b, const Tensor& A_log, const Tensor& dt_bias);
void gated_delta_gates_backward(const Stream& stream, const Tensor& da, const Tensor& db, const Tensor& dA_log,
                                const Tensor& ddt_bias, const Tensor& dg, const Tensor& dbeta, const Tensor& a,
                                const Tensor& b, const Tensor& A_log, const Tensor& dt_bias);
// One block per (document, value head), 4 threads per value column, each holding ceil(dk / 4) rows of the state
// (dk <= 128, dv <= 128). Generation's prefill and steps (ops::gated_delta_rule_prefill / _decode): a document
// starts from initial_state (f32 [D, Hv, dk, dv]; undefined: 0) and leaves its last state in final_state (the same
// shape, may be the same tensor; undefined: not kept).
void gated_delta_rule_sequential_forward(const Stream& stream, const Tensor& out, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                         float scale, const Tensor& initial_state = Tensor(),
                                         const Tensor& final_state = Tensor());
// The reverse scan: a forward pass keeps the state before every kGdnChunk tokens (f32, (T / kGdnChunk + documents) *
// Hv states), then each chunk's states are recomputed from it into a per-block scratch and walked backwards. dq and dk
// go through a per-value-head f32 buffer summed over the head group in ascending order.
void gated_delta_rule_sequential_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                          const Tensor& dg, const Tensor& dbeta, const Tensor& dout, const Tensor& q,
                                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                          const Tensor& cu_seqlens, float scale);
void gated_rmsnorm_forward(const Stream& stream, const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& z,
                           const Tensor& w, float eps);
void gated_rmsnorm_backward(const Stream& stream, const Tensor& dx, const Tensor& dz, const Tensor& dw,
                            const Tensor& dy, const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd,
                            float eps);

constexpr int64_t kGdnChunk = 64;          // tokens per chunk (chunked kernels), between checkpoints (sequential)
constexpr int64_t kGdnRowsPerChunk = 128;  // rows per partial sum of a weight gradient

}  // namespace moetrain::ops::cuda
