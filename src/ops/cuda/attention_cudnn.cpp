// defines: the cuDNN side of CUDA attention (ops/cuda/attention_cudnn.h), host code: SDPA forward and backward
// graphs of the cuDNN frontend over packed documents in THD layout (ragged offsets, per-document lengths, padding
// mask, causal band for a sliding window; a dense graph without them when every document fills a row of a power-of-two
// length), the per-device cuDNN handle, and the cache of built graphs per shape bucket.
#include "ops/cuda/attention_cudnn.h"

#if MOETRAIN_HAS_CUDA

#include <algorithm>
#include <atomic>
#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn.h>
// The graph API does not need the frontend's JSON (de)serialisation; skipping it keeps this file quick to compile.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include "core/error.h"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

// Every cuDNN library call goes through this: a failing status raises moetrain::Error with the call and the
// status's name.
#define MT_CUDNN_CHECK(call)                                                                                           \
  do {                                                                                                                 \
    const cudnnStatus_t mt_cudnn_status_ = (call);                                                                     \
    if (mt_cudnn_status_ != CUDNN_STATUS_SUCCESS) [[unlikely]] {                                                       \
      ::moetrain::throw_error(__FILE__, __LINE__,                                                                      \
                              ::fmt::format("cuDNN: {} failed: {} ({})", #call, cudnnGetErrorString(mt_cudnn_status_), \
                                            static_cast<int>(mt_cudnn_status_)));                                      \
    }                                                                                                                  \
  } while (0)

namespace moetrain::ops::cuda {

namespace fe = cudnn_frontend;

namespace {

using TensorAttr = std::shared_ptr<fe::graph::Tensor_attributes>;

constexpr int64_t kMinSeqBucket = 64;
constexpr int kOffsetRows = 5;  // q, k, v, o, stats

// Every frontend call returns an error object; a bad one becomes a moetrain::Error naming the graph and the stage.
void check_fe(fe::error_t status, const char* stage, const std::string& what) {
  if (status.is_good()) return;
  MT_FAIL("cuDNN SDPA ({}): {} failed: {} (frontend error code {}; cuDNN {} at run time)", what, stage,
          status.get_message(), static_cast<int>(status.get_code()), cudnnGetVersion());
}

int64_t next_power_of_two(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// One cuDNN handle per device, created on first use and kept for the life of the process (destroying it at exit
// would race the CUDA context's teardown). `mutex` serialises cudnnSetStream + execute on the shared handle.
struct HandleSlot {
  cudnnHandle_t handle = nullptr;
  std::mutex mutex;
};

HandleSlot& handle_for(Device device) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<HandleSlot>> slots;
  const std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<HandleSlot>& slot = slots[device.index];
  if (!slot) {
    int current = -1;
    MT_CUDA_CHECK(cudaGetDevice(&current));
    MT_CHECK(current == device.index, "cuDNN attention: tensors are on {} but the current CUDA device is cuda:{}",
             device.str(), current);
    auto fresh = std::make_unique<HandleSlot>();
    MT_CUDNN_CHECK(cudnnCreate(&fresh->handle));
    slot = std::move(fresh);
  }
  return *slot;
}

struct GraphKey {
  int device = 0;
  bool backward = false;
  int64_t batch = 0, seq = 0, tokens = 0;    // tokens: the backward's packed-token bucket (0 in the forward)
  int64_t nh = 0, nkv = 0, hd = 0, hdv = 0;  // hd: of q and k; hdv: of v and the output
  bool causal = true;
  int64_t window = 0;  // the causal band's width: key j is seen by query i when i - window < j <= i; 0: no band
  // Every document fills its S tokens: plain [B, heads, S, d] strides over the run, no ragged offsets, no sequence
  // lengths and no padding mask.
  bool dense = false;
  auto operator<=>(const GraphKey&) const = default;
};

std::string describe(const GraphKey& key) {
  return fmt::format("{} B={} S={}{} nh={} nkv={} hd={} hdv={} {}{} bf16{}", key.backward ? "backward" : "forward",
                     key.batch, key.seq, key.backward ? fmt::format(" T<={}", key.tokens) : std::string(), key.nh,
                     key.nkv, key.hd, key.hdv, key.causal ? "causal" : "non-causal",
                     key.window > 0 ? fmt::format(" window={}", key.window) : std::string(),
                     key.dense ? " dense" : " ragged");
}

// A built graph and the tensor attributes its variant pack is keyed by.
struct SdpaGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  TensorAttr q, k, v, o, stats, dout, dq, dk, dv;  // o, stats: outputs of the forward, inputs of the backward
  TensorAttr scale, seq_q, seq_kv;
  TensorAttr offsets[kOffsetRows];
  int64_t workspace_bytes = 0;
};

std::atomic<int64_t> g_graphs_built{0};

// The causal band of both graphs, in each document's own coordinates (the top-left diagonal of a document's
// S x S score tile is position 0 of the document): right bound 0 keeps keys j <= i, left bound W keeps j > i - W
// (the frontend's sliding_window_mask: column + W > row), the visibility rule of the CPU reference.
template <typename Options>
void set_band(Options& options, const GraphKey& key) {
  if (!key.causal) return;
  options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  if (key.window > 0) options.set_diagonal_band_left_bound(static_cast<int>(key.window));
}

// The sequence-length inputs and padding mask of a ragged graph (a dense one has neither).
template <typename Options>
void set_padding(Options& options, const SdpaGraph& g, const GraphKey& key) {
  if (key.dense) return;
  options.set_padding_mask(true).set_seq_len_q(g.seq_q).set_seq_len_kv(g.seq_kv);
}

// Tensors of the graph in THD layout: logical [B, heads, S, d] over a packed [T, heads, d] run, document b starting
// at element offsets[b] (a ragged offset), so the batch stride is never used for addressing. A dense graph's
// documents all fill S tokens, so document b starts at b * S tokens: the batch stride addresses it.
std::shared_ptr<SdpaGraph> build_graph(const GraphKey& key, cudnnHandle_t handle) {
  const std::string what = describe(key);
  auto g = std::make_shared<SdpaGraph>();
  g->graph = std::make_shared<fe::graph::Graph>();
  fe::graph::Graph& graph = *g->graph;
  graph.set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t b = key.batch, s = key.seq, d = key.hd, dv = key.hdv;

  const char* offset_names[kOffsetRows] = {"offset_q", "offset_k", "offset_v", "offset_o", "offset_stats"};
  for (int r = 0; r < kOffsetRows && !key.dense; ++r) {
    g->offsets[r] = graph.tensor(fe::graph::Tensor_attributes()
                                     .set_name(offset_names[r])
                                     .set_dim({b + 1, 1, 1, 1})
                                     .set_stride({1, 1, 1, 1})
                                     .set_data_type(fe::DataType_t::INT64));
  }
  // Sets a THD tensor's ragged offset (row r of the tables); a dense graph has none.
  const auto ragged = [&](const TensorAttr& t, int r) -> TensorAttr {
    if (!key.dense) t->set_ragged_offset(g->offsets[r]);
    return t;
  };
  const auto thd = [&](const char* name, int64_t heads, int64_t dim, int offset_row) {
    return ragged(graph.tensor(fe::graph::Tensor_attributes()
                                   .set_name(name)
                                   .set_dim({b, heads, s, dim})
                                   .set_stride({s * heads * dim, dim, heads * dim, 1})),
                  offset_row);
  };
  const auto seq_lens = [&](const char* name) {
    return graph.tensor(fe::graph::Tensor_attributes()
                            .set_name(name)
                            .set_dim({b, 1, 1, 1})
                            .set_stride({1, 1, 1, 1})
                            .set_data_type(fe::DataType_t::INT32));
  };
  g->q = thd("q", key.nh, d, 0);
  g->k = thd("k", key.nkv, d, 1);
  g->v = thd("v", key.nkv, dv, 2);
  if (!key.dense) {
    g->seq_q = seq_lens("seq_len_q");
    g->seq_kv = seq_lens("seq_len_kv");
  }
  g->scale = graph.tensor(fe::graph::Tensor_attributes()
                              .set_name("attn_scale")
                              .set_dim({1, 1, 1, 1})
                              .set_stride({1, 1, 1, 1})
                              .set_is_pass_by_value(true)
                              .set_data_type(fe::DataType_t::FLOAT));
  // lse [T, nh] seen as [B, nh, S, 1]: token stride nh, head stride 1, document b at offset c_b * nh.
  const std::vector<int64_t> stats_dim = {b, key.nh, s, 1};
  const std::vector<int64_t> stats_stride = {key.nh * s, 1, key.nh, 1};

  if (!key.backward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("moetrain_sdpa_forward")
                       .set_generate_stats(true)
                       .set_attn_scale(g->scale)
                       // The classic (composite) engines: what cuDNN 9.14 runs for ragged + padding; later cuDNN's
                       // unified engine would be picked by AUTO and behave differently across versions.
                       .set_implementation(fe::AttentionImplementation_t::COMPOSITE);
    set_padding(options, *g, key);
    set_band(options, key);
    auto [o, stats] = graph.sdpa(g->q, g->k, g->v, options);
    ragged(o, 3)->set_output(true).set_dim({b, key.nh, s, dv}).set_stride({s * key.nh * dv, dv, key.nh * dv, 1});
    MT_CHECK(stats != nullptr, "cuDNN SDPA ({}): the forward graph produced no softmax statistics", what);
    ragged(stats, 4)->set_output(true).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dim).set_stride(stats_stride);
    g->o = o;
    g->stats = stats;
  } else {
    g->o = thd("o", key.nh, dv, 3);
    g->dout = thd("dout", key.nh, dv, 3);
    // A dense graph reads the statistics packed [B, nh, S] (stats_to_bhsd); a ragged one where the forward wrote them.
    const std::vector<int64_t> packed_bhsd = {key.nh * s, s, 1, 1};
    g->stats = ragged(graph.tensor(fe::graph::Tensor_attributes()
                                       .set_name("stats")
                                       .set_dim(stats_dim)
                                       .set_stride(key.dense ? packed_bhsd : stats_stride)
                                       .set_data_type(fe::DataType_t::FLOAT)),
                      4);
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("moetrain_sdpa_backward")
                       .set_attn_scale(g->scale)
                       .set_deterministic_algorithm(false);
    set_padding(options, *g, key);
    if (!key.dense) {
      // Packed token totals: the f32 dq accumulator and the GQA full-head dk / dv scratch are sized by T instead of
      // B x S.
      options.set_max_total_seq_len_q(key.tokens).set_max_total_seq_len_kv(key.tokens);
    }
    set_band(options, key);
    auto [dq, dk, dv_out] = graph.sdpa_backward(g->q, g->k, g->v, g->o, g->dout, g->stats, options);
    ragged(dq, 0)->set_output(true).set_dim({b, key.nh, s, d}).set_stride({s * key.nh * d, d, key.nh * d, 1});
    ragged(dk, 1)->set_output(true).set_dim({b, key.nkv, s, d}).set_stride({s * key.nkv * d, d, key.nkv * d, 1});
    ragged(dv_out, 2)
        ->set_output(true)
        .set_dim({b, key.nkv, s, dv})
        .set_stride({s * key.nkv * dv, dv, key.nkv * dv, 1});
    g->dq = dq;
    g->dk = dk;
    g->dv = dv_out;
  }

  check_fe(graph.validate(), "validate", what);
  check_fe(graph.build_operation_graph(handle), "build_operation_graph", what);
  check_fe(graph.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", what);
  check_fe(graph.check_support(), "check_support", what);
  check_fe(graph.build_plans(), "build_plans", what);
  check_fe(graph.get_workspace_size(g->workspace_bytes), "get_workspace_size", what);
  g_graphs_built.fetch_add(1);
  return g;
}

// Built graphs per key. A training run meets a handful of buckets; the cache is never emptied.
std::shared_ptr<SdpaGraph> cached_graph(const GraphKey& key, cudnnHandle_t handle) {
  static std::mutex mutex;
  static std::map<GraphKey, std::shared_ptr<SdpaGraph>> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<SdpaGraph>& entry = cache[key];
  if (!entry) entry = build_graph(key, handle);
  return entry;
}

struct Extents {
  int64_t tokens, nh, nkv, hd, hdv, docs, batch, seq, window;
  bool dense;
};

// The graph's batch and sequence extents: with `allow_dense`, T = D * max_seqlen (every document then holds exactly
// max_seqlen tokens, as no document may be longer) and max_seqlen a power of two of at least kMinSeqBucket (so that
// dense graphs stay as few as ragged ones), B = D and S = max_seqlen in a dense graph; otherwise B and S are D and
// max_seqlen rounded up to powers of two in a ragged one, so that few graphs serve varying batches.
Extents extents_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens,
                   const AttentionParams& params, bool allow_dense, const char* op) {
  MT_CHECK(cudnn_attention_supports(q.dtype(), q.size(2), v.size(2), params),
           "{} (cuDNN): expected bf16 with (hd, hdv) in (64, 64), (128, 128), (256, 256) or (192, 128), max_seqlen > 0 "
           "and a "
           "sliding window only with the causal mask but found q {}, v {}, max_seqlen {}, sliding_window {}, causal {}",
           op, q.describe(), v.describe(), params.max_seqlen, params.sliding_window, params.causal);
  Extents e{q.size(0), q.size(1), k.size(1), q.size(2), v.size(2), cu_seqlens.numel() - 1, 0, 0, 0, false};
  MT_CHECK(e.docs >= 1, "{} (cuDNN): cu_seqlens needs at least 2 entries but found {}", op, cu_seqlens.describe());
  // cuDNN's ragged offsets are i64 and its sequence lengths i32.
  MT_CHECK(params.max_seqlen <= (int64_t{1} << 30),
           "{} (cuDNN): max_seqlen {} is beyond the 2^30 tokens the i32 sequence lengths allow", op, params.max_seqlen);
  e.dense = allow_dense && e.tokens == e.docs * params.max_seqlen && params.max_seqlen >= kMinSeqBucket &&
            next_power_of_two(params.max_seqlen) == params.max_seqlen;
  e.batch = e.dense ? e.docs : next_power_of_two(e.docs);
  e.seq = e.dense ? params.max_seqlen : std::max(kMinSeqBucket, next_power_of_two(params.max_seqlen));
  // Documents are at most S tokens long (fill_ragged_tables traps otherwise), so a band of S or more keys hides
  // nothing: such a window shares the graph of plain causal attention.
  e.window = params.sliding_window < e.seq ? params.sliding_window : 0;
  for (const Tensor* t : {&q, &k, &v}) {
    MT_CHECK(reinterpret_cast<uintptr_t>(t->raw_data()) % 16 == 0,
             "{} (cuDNN): expected 16-byte aligned operands but {} starts at {}", op, t->describe(), t->raw_data());
  }
  return e;
}

// The per-call device tables: sequence lengths (i32 [B]) and the five ragged offset rows (i64 [5, B + 1], rows
// padded to 16 bytes).
struct RaggedTables {
  Tensor seq_lens, offsets;
};

// A dense graph's call checks on the device that document b starts at token b * S (it traps otherwise, as the
// ragged tables do for a document over max_seqlen) and needs no tables.
RaggedTables ragged_tables(const Stream& stream, const Extents& e, const Tensor& cu_seqlens, Device device) {
  RaggedTables t;
  if (e.dense) {
    check_dense_documents(stream, cu_seqlens, e.seq);
    return t;
  }
  t.seq_lens = Tensor::empty({e.batch}, DType::I32, device);
  t.offsets = Tensor::empty({kOffsetRows, (e.batch + 2) / 2 * 2}, DType::I64, device);
  const RaggedMultipliers m{e.nh * e.hd, e.nkv * e.hd, e.nkv * e.hdv, e.nh * e.hdv, e.nh};
  fill_ragged_tables(stream, t.seq_lens, t.offsets, cu_seqlens, e.batch, e.seq, m);
  return t;
}

void* offset_row(const RaggedTables& t, int row) {
  return static_cast<int64_t*>(t.offsets.raw_data()) + row * t.offsets.size(1);
}

using VariantPack = std::unordered_map<TensorAttr, void*>;

void add_tables(VariantPack& pack, const SdpaGraph& g, const RaggedTables& t) {
  if (!t.offsets.defined()) return;  // a dense graph
  pack[g.seq_q] = t.seq_lens.raw_data();
  pack[g.seq_kv] = t.seq_lens.raw_data();
  for (int r = 0; r < kOffsetRows; ++r) pack[g.offsets[r]] = offset_row(t, r);
}

void execute(const Stream& stream, const GraphKey& key, const SdpaGraph& g, VariantPack& pack, Device device) {
  // The workspace comes from the stream-ordered pool; its release is ordered after the graph's kernels. Before 9.19
  // the backward's starts zeroed: older Hopper backwards can read their workspace before writing it (Transformer
  // Engine zeroes it for that reason; at head dim 256 ours gave nan and inf from whatever the pool held under 9.14,
  // and repeatable values once zeroed). From 9.19 the pass over it (hundreds of MB a call at the workload's shape) is
  // skipped; CudaAttentionCudnn.BackwardIgnoresWhatItsWorkspaceHeld fills the pool with NaN first to hold that.
  const Tensor workspace = Tensor::empty({std::max<int64_t>(g.workspace_bytes, 1)}, DType::U8, device);
  if (key.backward && cudnn_runtime_version() < kCudnnFirstBackwardWithoutZeroedWorkspace) {
    MT_CUDA_CHECK(cudaMemsetAsync(workspace.raw_data(), 0, static_cast<size_t>(workspace.numel()),
                                  static_cast<cudaStream_t>(stream_handle(stream))));
  }
  HandleSlot& slot = handle_for(device);
  const std::lock_guard<std::mutex> lock(slot.mutex);
  MT_CUDNN_CHECK(cudnnSetStream(slot.handle, static_cast<cudaStream_t>(stream_handle(stream))));
  check_fe(g.graph->execute(slot.handle, pack, workspace.raw_data()), "execute", describe(key));
}

}  // namespace

bool cudnn_attention_supports(DType dtype, int64_t hd, int64_t hdv, const AttentionParams& params) {
  // Equal head dims of 64, 128 (Qwen3, GPT-OSS) or 256 (Qwen3.5's full attention), and DeepSeek-V2's latent
  // attention: q/k 192 (128 + 64 rope), v 128.
  const bool dims = ((hd == 64 || hd == 128 || hd == 256) && hdv == hd) || (hd == 192 && hdv == 128);
  // A sliding window needs the causal mask here: the non-causal (symmetric) window stays on our kernels (cuDNN 9.14.0
  // also refuses non-causal windows over more than 1024 keys).
  return dtype == DType::BF16 && dims && params.max_seqlen > 0 && (params.sliding_window == 0 || params.causal);
}

bool cudnn_attention_backward_supports(DType dtype, int64_t hd, int64_t hdv, const AttentionParams& params) {
  // Head dim 256 only from cuDNN 9.19: 9.14's forward is right there, but its Hopper backward gives wrong dq, dk and dv
  // (relative errors 0.2 to 5 against the CPU with both engines it offers, causal or not, one document or several,
  // workspace zeroed or not: docs/gpu_notes.md, seventh session). 9.19 is the first release seen right (eighth
  // session); the versions between were never at hand, so they stay on our kernels.
  const bool head_dim_ok = hd != 256 || cudnn_runtime_version() >= kCudnnFirstRightHeadDim256Backward;
  return cudnn_attention_supports(dtype, hd, hdv, params) && head_dim_ok;
}

int64_t cudnn_attention_graphs_built() { return g_graphs_built.load(); }

void cudnn_attention_forward(const Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& cu_seqlens, const AttentionParams& params,
                             bool allow_dense) {
  constexpr const char* op = "attention_forward";
  const Extents e = extents_of(q, k, v, cu_seqlens, params, allow_dense, op);
  const Device device = q.device();
  const GraphKey key{device.index, false, e.batch, e.seq,         0,        e.nh,
                     e.nkv,        e.hd,  e.hdv,   params.causal, e.window, e.dense};
  const std::shared_ptr<SdpaGraph> g = cached_graph(key, handle_for(device).handle);
  const RaggedTables tables = ragged_tables(stream, e, cu_seqlens, device);
  float scale = params.softmax_scale;
  VariantPack pack = {{g->q, q.raw_data()},   {g->k, k.raw_data()},       {g->v, v.raw_data()},
                      {g->o, out.raw_data()}, {g->stats, lse.raw_data()}, {g->scale, &scale}};
  add_tables(pack, *g, tables);
  execute(stream, key, *g, pack, device);
}

void cudnn_attention_backward(const Stream& stream, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& cu_seqlens, const AttentionParams& params,
                              bool allow_dense) {
  constexpr const char* op = "attention_backward";
  MT_CHECK(cudnn_attention_backward_supports(q.dtype(), q.size(2), v.size(2), params),
           "{} (cuDNN): head dim {} is not taken by the cuDNN backward (its results are wrong there); the backward of "
           "this call runs on our kernels",
           op, q.size(2));
  const Extents e = extents_of(q, k, v, cu_seqlens, params, allow_dense, op);
  const Device device = q.device();
  const int64_t token_bucket = std::max(kMinSeqBucket, next_power_of_two(e.tokens));
  const GraphKey key{device.index, true, e.batch, e.seq,         token_bucket, e.nh,
                     e.nkv,        e.hd, e.hdv,   params.causal, e.window,     e.dense};
  const std::shared_ptr<SdpaGraph> g = cached_graph(key, handle_for(device).handle);
  const RaggedTables tables = ragged_tables(stream, e, cu_seqlens, device);
  Tensor stats = lse;
  if (e.dense) {
    stats = Tensor::empty(lse.shape(), DType::F32, device);
    stats_to_bhsd(stream, stats, lse, e.batch, e.seq);
  }
  float scale = params.softmax_scale;
  VariantPack pack = {{g->q, q.raw_data()},   {g->k, k.raw_data()},       {g->v, v.raw_data()},
                      {g->o, out.raw_data()}, {g->dout, dout.raw_data()}, {g->stats, stats.raw_data()},
                      {g->dq, dq.raw_data()}, {g->dk, dk.raw_data()},     {g->dv, dv.raw_data()},
                      {g->scale, &scale}};
  add_tables(pack, *g, tables);
  execute(stream, key, *g, pack, device);
}

}  // namespace moetrain::ops::cuda

#endif  // MOETRAIN_HAS_CUDA
