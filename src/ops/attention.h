// defines: causal grouped-query attention over packed documents. A micro-batch is a flat run of T
// tokens cut into documents by cu_seqlens; a query attends only to keys of its own document, at or
// before its position. Forward saves the log-sum-exp per (token, head) for the backward.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

struct AttentionParams {
  float softmax_scale = 1.0f;  // usually 1 / sqrt(head dim)
  bool causal = true;
  int sliding_window = 0;  // 0: unlimited; w > 0: a query sees the w most recent keys (itself included)
  // Host-known length of the longest document in cu_seqlens (0 = unknown). On CUDA, bf16 calls with (hd, hdv) in
  // (64, 64), (128, 128), (256, 256), (192, 128), max_seqlen > 0 and, if there is a sliding window, the causal mask run
  // on cuDNN's fused SDPA (ops/cuda/attention_cudnn.h), which needs it to size its graphs (at head dim 256 the backward
  // only with cuDNN 9.19 or later at run time: 9.14's is wrong there); every other call runs on our own kernels. Must
  // be >= the longest document (checked on the CPU; on CUDA a longer document traps the device, since the host cannot
  // read cu_seqlens there).
  //
  // Determinism: cuDNN's forward is deterministic, its backward is NOT (dq is accumulated in f32 with atomics), so
  // lanes that need bitwise-reproducible gradients must leave max_seqlen at 0 (our kernels: deterministic and
  // packing-invariant).
  int64_t max_seqlen = 0;
};

// q [T, nh, hd], k [T, nkv, hd], v [T, nkv, hdv], nh % nkv == 0 (query head h reads kv head
// h / (nh / nkv)); cu_seqlens i32 [D + 1] on the CPU (0 = c0 < c1 < ... < cD = T);
// for CUDA tensors cu_seqlens lives on the device and is validated by the caller (validate_cu_seqlens on the host).
// out [T, nh, hdv]; lse [T, nh] (f32, or f64 with f64 inputs).
void attention_forward(Stream& stream, Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cu_seqlens, const AttentionParams& params);
// Decoding with a cache (generation): row b of q [B, nh, hd] is the newest token of sequence b, at position
// lengths[b] - 1, whose keys and values (its own included) are rows 0 .. lengths[b] - 1 of k_cache [B, C, nkv, hd] and
// v_cache [B, C, nkv, hdv] (1 <= lengths[b] <= C; lengths i32 [B] on the CPU, the host's count). out [B, nh, hdv], lse
// [B, nh]. It sees the keys attention_forward shows that token in its document (causal, the sliding window) and
// computes each query with the same instructions, so its bytes equal the training forward's for the same keys.
// params.causal must be true; max_seqlen is ignored. CPU (f32, f64) and CUDA (f32, bf16, head dims up to 256): on
// CUDA the bytes of out and lse equal those of our own CUDA attention_forward (max_seqlen = 0, not cuDNN) for that
// token, its document being the cache rows 0 .. lengths[b] - 1 (the per-row arithmetic both kernels share:
// ops/cuda/attention_row.cuh).
void attention_decode_forward(Stream& stream, Tensor out, Tensor lse, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, const Tensor& lengths, const AttentionParams& params);
// dq, dk, dv are overwritten (not accumulated). Reductions run in ascending token order.
void attention_backward(Stream& stream, Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& cu_seqlens, const AttentionParams& params);

// Attention sinks (GPT-OSS): a learned logit per query head, sinks[h] (in the units of the scaled scores
// softmax_scale * q.k), joins every softmax denominator of head h with a zero value vector. They are applied to the
// results of attention_forward, so every backend's attention runs unchanged:
//   out [T, nh, hdv] and lse [T, nh] from attention_forward are rewritten in place to the sinked attention:
//   out *= sigmoid(lse - sinks[h]), lse = logaddexp(lse, sinks[h]) (natural log, the convention of attention_forward).
// dtypes: out as the attention (CPU f32 / f64, CUDA f32 / bf16), lse as attention_forward writes it (f32, or f64 with
// f64 CPU inputs), sinks [nh] f32 (f64 with f64 CPU inputs). All contiguous, on the stream's device.
void attention_sinks_forward(Stream& stream, Tensor out, Tensor lse, const Tensor& sinks);
// dsinks [nh] += -sum_t exp(sinks[h] - lse[t, h]) * <dout[t, h, :], out[t, h, :]>, where out and lse are
// attention_sinks_forward's outputs (the sinked ones). The sum over tokens runs in a fixed order: ascending on the
// CPU; on CUDA ascending within chunks of tokens, then the chunk sums in ascending order (deterministic, no atomics).
// dq, dk, dv of the sinked attention: attention_backward with the same dout and the SINKED out and lse (the softmax
// gradient dS_j = P'_j (dP_j - <dout, out'>) already counts the sink column, whose value vector is 0).
// dout as out; dsinks as sinks.
void attention_sinks_backward(Stream& stream, Tensor dsinks, const Tensor& dout, const Tensor& out, const Tensor& lse,
                              const Tensor& sinks);

// Validates cu_seqlens for `num_tokens`: i32, 1-D, >= 2 entries, starts at 0, strictly increasing,
// ends at num_tokens. The error names the first entry that breaks a rule.
void validate_cu_seqlens(const Tensor& cu_seqlens, int64_t num_tokens, const char* what);

}  // namespace moetrain::ops
