// defines: the Gated DeltaNet ops of Qwen3.5's linear-attention layers (transformers 5.17's Qwen3_5GatedDeltaNet): the
// short causal depthwise conv with its SiLU, the q/k L2 norm, the decay and write-strength gates, the gated delta rule
// over packed documents, and the SiLU-gated output RMSNorm; each with its backward.
#pragma once

#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// Dtypes. CPU: every tensor in one float dtype, f32 or f64 (that of the first input: x, q or a). CUDA: activations
// (x, y, dx, dy, z, dz of the conv and the norms; q, k, v, out and their gradients; a, b, da, db) in f32 or bf16 (one
// dtype per call, the first input's), computed in f32; g, beta, dg, dbeta, rstd and every 1-D weight and its gradient
// (A_log, dt_bias, the gated norm's w) in f32; the conv's w in f32 or bf16 (a matrix's compute copy), its dw in f32.
// cu_seqlens: i32 [D + 1], 0 = cu[0] < cu[1] < ... < cu[D] = T; on the CPU validated here, on CUDA its values are the
// caller's contract (ops::validate_cu_seqlens on the host copy, as for attention).

// The short causal depthwise conv of Gated DeltaNet with its SiLU (transformers' causal_conv1d_fn: F.conv1d with
// padding K - 1, the first T outputs, then silu): y[t, c] = silu(sum_{j<K} w[c, j] * x[t - (K-1) + j, c]), where rows
// before the start of t's document (cu_seqlens) count as 0: documents never see each other.
// x, y [T, C]; w [C, K] (HF conv1d.weight [C, 1, K] viewed as [C, K]); no bias.
void causal_conv1d_silu_forward(Stream& s, Tensor y, const Tensor& x, const Tensor& w, const Tensor& cu_seqlens);
// dx [T, C] (overwritten) and dw [C, K] (+=, rows summed in ascending order) from dy.
void causal_conv1d_silu_backward(Stream& s, Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                                 const Tensor& cu_seqlens);

// L2 normalisation over the last dim as transformers' Qwen3.5 l2norm: y = x * rsqrt(sum(x^2) + eps) (eps 1e-6), rows of
// x [N, D] (any shape, viewed as [numel / D, D]); the backward from the saved x. dx may not alias dy.
void l2norm_forward(Stream& s, Tensor y, const Tensor& x, float eps);
void l2norm_backward(Stream& s, Tensor dx, const Tensor& dy, const Tensor& x, float eps);

// The gates: g = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h]) (log-decay, <= 0; softplus as torch's, linear above
// 20), beta = sigmoid(b[t, h]). a, b, g, beta [T, H]; A_log, dt_bias [H].
void gated_delta_gates_forward(Stream& s, Tensor g, Tensor beta, const Tensor& a, const Tensor& b, const Tensor& A_log,
                               const Tensor& dt_bias);
// da, db [T, H] overwritten; dA_log, ddt_bias [H] += (tokens in ascending order).
void gated_delta_gates_backward(Stream& s, Tensor da, Tensor db, Tensor dA_log, Tensor ddt_bias, const Tensor& dg,
                                const Tensor& dbeta, const Tensor& a, const Tensor& b, const Tensor& A_log,
                                const Tensor& dt_bias);

// The gated delta rule over packed documents, the state restarting at 0 in each document (transformers 5.17's
// torch_recurrent_gated_delta_rule; its training path torch_chunk_gated_delta_rule computes the same). q, k [T, Hk, dk]
// (already L2-normalised), v [T, Hv, dv], Hv % Hk == 0 (value head h reads key head h / (Hv / Hk), transformers'
// repeat_interleave); g, beta [T, Hv]; out [T, Hv, dv]. `scale` multiplies q here (transformers: 1 / sqrt(dk)).
// Per document and value head, S (dk x dv) from 0, for each token t in order:
//   S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  out_t = S^T (scale * q_t).
//
// `saved`, when given, receives what the backward would otherwise recompute: on CUDA the chunked kernels' w, U,
// chunk-start states and Tm (f32; about 4 (dk + dv) + 4 dk dv / 64 + 64 bytes per token and value head, 300 MB for
// 4096 tokens of Qwen3.5's 32 heads of 128); the CPU keeps nothing there.
struct GatedDeltaSaved {
  std::vector<Tensor> tensors;  // the backend's; empty: nothing saved
};
void gated_delta_rule_forward(Stream& s, Tensor out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, const Tensor& cu_seqlens, float scale,
                              GatedDeltaSaved* saved = nullptr);
// dq, dk [T, Hk, dk], dv [T, Hv, dv], dg, dbeta [T, Hv], all overwritten (dq / dk summed over the value heads sharing a
// key head, in ascending head order). CUDA: dk <= 128 and dv <= 128. `saved`: what the forward on these same inputs
// kept (its shapes are checked, its contents are the caller's contract), or null / empty to recompute it; the results
// are the same bytes either way (the kernels are deterministic), and `saved` is left as it was.
void gated_delta_rule_backward(Stream& s, Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, const Tensor& dout,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& cu_seqlens, float scale, const GatedDeltaSaved* saved = nullptr);

// Generation (docs/generation.md). The prefill: gated_delta_rule_forward over the prompts (the documents of
// cu_seqlens), also leaving each document's final state in final_state [D, Hv, dk, dv] (the gates' dtype: f32 on
// CUDA, where the prefill runs the sequential scan, whose state lives in registers, not the chunked kernels).
void gated_delta_rule_prefill(Stream& s, Tensor out, Tensor final_state, const Tensor& q, const Tensor& k,
                              const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                              float scale);
// A step: row b of q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv] is sequence b's newest token, state [B, Hv, dk,
// dv] its state before it (updated in place; the gates' dtype); out [B, Hv, dv]. The CPU forward's per-token code:
// its bytes.
void gated_delta_rule_decode(Stream& s, Tensor out, Tensor state, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& g, const Tensor& beta, float scale);
// A step of the conv: sequence b's conv inputs so far are rows 0 .. lengths[b] - 1 of history [B, capacity, C], the
// newest last (lengths i32 [B] on the CPU); y [B, C] is the newest one's output, as causal_conv1d_silu_forward
// computes it in its document.
void causal_conv1d_silu_decode(Stream& s, Tensor y, const Tensor& history, const Tensor& w, const Tensor& lengths);

// The output norm of Gated DeltaNet (transformers' Qwen3_5RMSNormGated, not zero-centred): y = w * (x * rstd) *
// silu(z) per row of x, z [N, D] (any shape, viewed as [numel / D, D]), rstd = 1 / sqrt(mean(x^2) + eps); w [D]; rstd
// [N] saved for the backward.
void gated_rmsnorm_forward(Stream& s, Tensor y, Tensor rstd, const Tensor& x, const Tensor& z, const Tensor& w,
                           float eps);
// dx, dz [N, D] overwritten; dw [D] += (rows ascending).
void gated_rmsnorm_backward(Stream& s, Tensor dx, Tensor dz, Tensor dw, const Tensor& dy, const Tensor& x,
                            const Tensor& z, const Tensor& w, const Tensor& rstd, float eps);

}  // namespace moetrain::ops
