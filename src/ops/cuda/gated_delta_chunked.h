// defines: the chunked CUDA form of the gated delta rule (ops/gated_delta.h), flash-linear-attention's
// chunk_gated_delta_rule in the WY representation: chunks of kGdnChunk tokens laid out per document (a chunk never
// straddles a document's end), the intra-chunk work parallel over (chunk, value head), the state passes parallel over
// (document, value head, 32 value columns) and sequential over chunks. Deterministic: no float atomics.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::gated_delta_rule_forward / _backward (ops/gated_delta.cpp): contiguous, on the stream's
// device, q / k / v / out and their gradients f32 or bf16 (computed in f32), g / beta / dg / dbeta f32, cu_seqlens
// i32 with valid values (the caller's contract), dk <= 128 and dv <= 128.
//
// Forward, per chunk (gc = cumsum of g in the chunk, G = exp(gc), F = exp(gc_last - gc), q' = scale q):
//   A = strictly lower beta_i (k_i . k_j) exp(gc_i - gc_j);  Tm = (I + A)^-1 (forward substitution);
//   w = Tm diag(beta G) K;  u = Tm diag(beta) V;
// then per (document, head), chunk after chunk from S = 0: U = u - w S (the chunk's state-corrected values),
// O = diag(G) Q' S + (Q' K^T . causal exp(gc_i - gc_j)) U, S = G_last S + (diag(F) K)^T U.
// Workspace (f32, from the device allocator): w [T, Hv, dk], u and U [T, Hv, dv], the chunk-start states
// [T / kGdnChunk + D, Hv, dk, dv].
// With `saved` not null it receives the chunk table, w, U, the chunk-start states and Tm for the backward (Tm is then
// computed here, as the backward's recomputation would).
void gated_delta_rule_chunked_forward(const Stream& stream, const Tensor& out, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                      float scale, std::vector<Tensor>* saved = nullptr);
// Backward: takes the forward's `saved` intermediates, or (null) recomputes w, u, U, the chunk-start states and Tm;
// then dU_local = (Q' K^T . mask)^T dO per chunk; the reverse state pass per (document, head) from dS = 0
// at the document's end: dU = dU_local + diag(F) K dS, dS = G_last dS + (diag(G) Q')^T dO - w^T dU (keeping the
// chunk-end dS); and per chunk the gradients through Tm (Y = Tm^T dU, dA = -Y U^T), the masks and the decays (dg
// through the in-chunk cumsum). dq / dk go through per-value-head f32 rows summed over the head group in ascending
// order. Workspace: the forward's plus Tm [T / kGdnChunk + D, Hv, 64, 64], the chunk-end dS (as the states) and the
// per-head dq, dk rows [T, Hv, dk] and dU [T, Hv, dv]. `saved` is only read; its shapes are checked.
void gated_delta_rule_chunked_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                       const Tensor& dg, const Tensor& dbeta, const Tensor& dout, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                       const Tensor& cu_seqlens, float scale,
                                       const std::vector<Tensor>* saved = nullptr);

// Bytes of device workspace one forward (backward = false) or backward call allocates for T tokens in D documents.
int64_t gated_delta_rule_chunked_workspace_bytes(int64_t tokens, int64_t docs, int64_t hv, int64_t dk, int64_t dv,
                                                 bool backward);

}  // namespace moetrain::ops::cuda
