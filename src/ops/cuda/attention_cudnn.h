// defines: causal grouped-query attention over packed documents (ops/attention.h) through cuDNN's fused SDPA graphs
// (the cuDNN frontend), bf16 in a THD layout with ragged offsets; plus the small kernel that turns the device
// cu_seqlens into the per-document tables cuDNN reads, so no host synchronisation is needed.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "ops/attention.h"

namespace moetrain::ops::cuda {

// Whether the cuDNN path takes a call: bf16, (hd, hdv) in (64, 64), (128, 128), (256, 256), (192, 128), a host-known
// longest document (params.max_seqlen > 0), and a sliding window only with the causal mask (a band i - W < j <= i in
// each document, the rule of the CPU reference). Everything else runs on the kernels of ops/cuda/attention.h.
bool cudnn_attention_supports(DType dtype, int64_t hd, int64_t hdv, const AttentionParams& params);
// Whether its backward takes the call too: at head dim 256 only with cuDNN 9.19 or later at run time (older Hopper
// backwards give wrong gradients there); otherwise that backward runs on our kernels from the cuDNN forward's out and
// lse (the same natural-log lse layout, [T, nh] f32).
bool cudnn_attention_backward_supports(DType dtype, int64_t hd, int64_t hdv, const AttentionParams& params);
// The first cuDNN release whose head-dim-256 backward was seen right, as cudnnGetVersion() spells it.
// Compared with ops::cuda::cudnn_runtime_version() (ops/cuda/runtime.h).
inline constexpr int kCudnnFirstRightHeadDim256Backward = 91900;
// The first release whose backward is run on a workspace left as the pool holds it (older ones get it zeroed).
inline constexpr int kCudnnFirstBackwardWithoutZeroedWorkspace = 91900;

// The arguments are validated by ops::attention_forward / ops::attention_backward (shapes, dtypes, devices) and
// must satisfy cudnn_attention_supports (checked again here). cu_seqlens i32 [D + 1] on the device: its values are
// the caller's contract, and every document must be at most params.max_seqlen tokens long: a longer one makes the
// table kernel trap (a sticky CUDA error) rather than let cuDNN read or write out of bounds.
//
// Documents become cuDNN's batch: B = D rounded up to a power of two (the extra documents have length 0),
// S = max_seqlen rounded up to a power of two (at least 64). Built graphs are cached per (device, B, S, token bucket
// (backward), nh, nkv, hd, causal, window); the softmax scale is a run-time scalar, not part of the key. A window of
// S or more keys hides nothing (no document is longer than S) and shares the graphs of plain causal attention.
//
// lse is cuDNN's softmax statistic, the natural-log log-sum-exp of the scaled scores, written straight into
// lse [T, nh] through a ragged offset (a dense graph: through its batch stride): the same convention as the other CUDA
// kernels and the CPU reference.
// With `allow_dense`, T = D * max_seqlen (every document fills max_seqlen tokens) and max_seqlen a power of two of at
// least 64, the graph addresses documents by a batch stride instead of ragged offsets and has no padding mask, and
// its backward reads the softmax statistics transposed to [B, nh, S] (stats_to_bhsd). Measured on an H200 at the
// workload of record's shape (2 x 4096 tokens, 32 / 4 heads, hd 128, causal): forward 0.510 -> 0.475 ms, forward +
// backward 2.100 -> 1.954 ms (CudaAttentionCudnnBench), the errors against the CPU those of the ragged graph.
inline constexpr bool kCudnnDenseDocuments = true;
void cudnn_attention_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params,
                             bool allow_dense = kCudnnDenseDocuments);
// dq, dk, dv are overwritten. NOT deterministic: cuDNN accumulates dq in f32 with atomics across key tiles, so
// repeated runs may differ in the last bits (cuDNN's deterministic mode on Hopper needs an S x S score workspace
// per (document, head), which packed batches cannot afford).
void cudnn_attention_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& cu_seqlens, const AttentionParams& params,
                              bool allow_dense = kCudnnDenseDocuments);

// Graphs built so far in this process (forward and backward, all devices): a call that reuses a cached graph
// leaves it unchanged. For the tests of the cache.
int64_t cudnn_attention_graphs_built();

// Traps unless document b of cu_seqlens (i32 [D + 1]) starts at token b * seq for every b in [0, D]: the layout a
// dense graph assumes. Runs on `stream`, no host synchronisation.
void check_dense_documents(const Stream& stream, const Tensor& cu_seqlens, int64_t seq);

// bhsd [B, nh, S] f32 = lse [B S, nh] f32 transposed: the layout a dense graph's backward reads its softmax statistics
// in (cuDNN before 9.26 reads a non-ragged statistics input as packed [B, nh, S] whatever its declared strides).
void stats_to_bhsd(const Stream& stream, const Tensor& bhsd, const Tensor& lse, int64_t batch, int64_t seq);

// Element offsets of each document's first token in the THD tensors: token index times these.
struct RaggedMultipliers {
  int64_t q = 0, k = 0, v = 0, o = 0, stats = 0;
};

// Rows of `offsets` (i64 [5, row_stride], row_stride >= batch + 1): q, k, v, o, stats offsets of documents
// 0..batch (document b >= D is empty and starts at T). seq_lens i32 [batch]: the document lengths, 0 past D.
// A document longer than max_len traps (see cudnn_attention_forward). Runs on `stream`, no host synchronisation.
void fill_ragged_tables(const Stream& stream, const Tensor& seq_lens, const Tensor& offsets, const Tensor& cu_seqlens,
                        int64_t batch, int64_t max_len, const RaggedMultipliers& multipliers);

}  // namespace moetrain::ops::cuda
