// defines: the memory planner: parameter bytes from the family's specs, and a replay of one step's allocations (the
// blocks' records, the head, ZeRO-3's hooks, the DualPipeV op list) through a byte ledger.
#include "train/memory_plan.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>

#include <fmt/format.h>

#include "core/error.h"
#include "dist/mesh.h"
#include "model/family.h"
#include "model/flops.h"
#include "model/model_config.h"
#include "model/parameter_store.h"
#include "pipeline/dualpipev_schedule.h"
#include "pipeline/partition.h"
#include "train/exact_job.h"

namespace moetrain::train {

namespace {

constexpr int64_t kStat = 4;   // statistics_dtype: f32 for bf16 and f32 activations (model/precision.h)
constexpr int64_t kIndex = 4;  // i32 indices

// Live bytes over time and their maximum.
struct Ledger {
  int64_t live = 0;
  int64_t peak = 0;
  void alloc(int64_t bytes) {
    live += bytes;
    peak = std::max(peak, live);
  }
  void free(int64_t bytes) { live -= bytes; }
};

// What one decoder layer's records hold per token, as its family describes it (Family::layer_activation_shape).
using LayerShape = model::LayerActivationShape;

struct Sizes {
  int64_t T = 0, H = 0, V = 0, E = 0, K = 0;
  int64_t c = 4;                         // compute dtype bytes
  int64_t s = 4;                         // residual stream dtype bytes (c, or 4 with model.residual_dtype = f32)
  bool recompute_activation = false;     // model.recompute = activation: act is not kept from the forward
  bool expert_weights_per_step = false;  // model.expert_weight_gradient = step: the expert MLP records held
  bool held_rows_from_tokens = false;    // ... holding the rows' token-side sources (no expert exchange: ep = 1)
  bool router_aux = false;               // router losses on: d_probs and d_logits [T, E] per MoE layer
  int64_t head_chunk = 0;
};

// Byte sizes of one layer's tensors for one micro-batch (names as in the blocks' records).
struct LayerBytes {
  int64_t hid, stream, stat_t, q, kv, q_stat, kv_stat, rows, gate_up, act, route_e, route_k_stat, route_k_idx, plan;
  int64_t aux;  // d_probs + d_logits of the router losses
  LayerBytes(const LayerShape& s, const Sizes& z) {
    const int64_t R = s.moe ? z.T * z.K : z.T;
    hid = z.T * z.H * z.c;
    stream = z.T * z.H * z.s;
    stat_t = z.T * kStat;
    q = z.T * s.q_cols * z.c;
    kv = z.T * s.kv_cols * z.c;
    q_stat = z.T * s.heads * kStat;
    kv_stat = z.T * s.kv_heads * kStat;
    rows = R * z.H * z.c;
    gate_up = R * 2 * s.width * z.c;
    act = R * s.width * z.c;
    route_e = s.moe ? z.T * z.E * kStat : 0;
    route_k_stat = s.moe ? z.T * z.K * kStat : 0;
    route_k_idx = s.moe ? z.T * z.K * kIndex : 0;
    plan = s.moe ? (z.E + 1) * kIndex + 2 * z.T * z.K * kIndex : 0;
    aux = s.moe && z.router_aux ? 2 * z.T * z.E * 4 : 0;
  }
};

// ZeRO-3's hooks (fully_sharded.cpp) on the ledger: the gathered compute weights and full gradients of each part.
struct ZeroPart {
  int64_t gathered = 0;    // full compute weights while gathered (padded, the whole expert bank)
  int64_t full_grad = 0;   // full fp32 gradient while live
  int64_t shard_grad = 0;  // one fp32 gradient shard (the reduced buffer of a later micro-batch)
};

class ZeroSim {
 public:
  // `one_queue`: compute and communication share one stream (the CPU), so a reduced gradient is freed at once;
  // with a communication stream (CUDA) it is freed when compute next waits for that stream.
  ZeroSim(Ledger& ledger, std::vector<ZeroPart> parts, bool every_micro_batch, int64_t micro_batches, bool tied,
          bool one_queue)
      : l_(ledger),
        parts_(std::move(parts)),
        every_(every_micro_batch),
        n_(micro_batches),
        tied_(tied),
        one_queue_(one_queue),
        gathered_(parts_.size(), false),
        grad_live_(parts_.size(), false),
        reduced_(parts_.size(), false) {}
  // Part indices: 0 embedding, 1..L layers, L + 1 head.
  size_t head() const { return parts_.size() - 1; }

  void before_forward(size_t p) {
    gather(p);
    wait();
    if (p != head()) gather(p + 1);
  }
  void after_forward(size_t p) {
    if (p == 0 && tied_) return;
    release(p);
  }
  void before_backward(size_t p) {
    if (p != 0) gather(p);
    wait();
    begin_grad(p);
    if (p == head() && tied_) begin_grad(0);
    if (p == head() && parts_.size() > 2) gather(p - 1);
    if (p != head() && p > 1) gather(p - 1);
  }
  void after_backward(size_t p) {
    const bool last = mb_ + 1 >= n_;
    if (p == 0) ++mb_;
    if (!every_ && !last) {
      release(p);
      return;
    }
    if (grad_live_[p]) {
      if (reduced_[p]) {
        l_.alloc(parts_[p].shard_grad);
        in_flight_ += parts_[p].shard_grad;
      }
      reduced_[p] = true;
      if (one_queue_) {
        l_.free(parts_[p].full_grad);
        grad_live_[p] = false;
      } else {
        pending_free_.push_back(p);
      }
    }
    release(p);
  }

 private:
  void gather(size_t p) {
    if (gathered_[p]) return;
    gathered_[p] = true;
    l_.alloc(parts_[p].gathered);
  }
  void release(size_t p) {
    if (!gathered_[p]) return;
    gathered_[p] = false;
    l_.free(parts_[p].gathered);
  }
  void begin_grad(size_t p) {
    if (grad_live_[p]) return;
    grad_live_[p] = true;
    l_.alloc(parts_[p].full_grad);
  }
  // wait_for_communication: the reduced full gradients and the in-flight buffers are freed.
  void wait() {
    for (size_t p : pending_free_) {
      if (grad_live_[p]) l_.free(parts_[p].full_grad);
      grad_live_[p] = false;
    }
    pending_free_.clear();
    l_.free(in_flight_);
    in_flight_ = 0;
  }

  Ledger& l_;
  std::vector<ZeroPart> parts_;
  bool every_;
  int64_t n_;
  bool tied_;
  bool one_queue_;
  std::vector<bool> gathered_, grad_live_, reduced_;
  std::vector<size_t> pending_free_;
  int64_t in_flight_ = 0;
  int64_t mb_ = 0;
};

// One stage's forward and backward on the ledger, in the order of pipeline/stage_chunk.cpp and the blocks.
class StageSim {
 public:
  StageSim(const std::vector<LayerShape>& shapes, const Sizes& z, const pipeline::StageLayers& stage)
      : shapes_(shapes), z_(z), stage_(stage) {}

  // Forward of one micro-batch; the stage's input (a received activation) is allocated here when the stage has no
  // embedding. Leaves the records alive; the output of a stage without the head is freed (sent).
  void forward(Ledger& l, ZeroSim* zero) {
    const int64_t hid = z_.T * z_.H * z_.s;  // the stream
    if (stage_.has_embedding) {
      if (zero) zero->before_forward(0);
      l.alloc(hid);  // the embedding's output
      if (zero) zero->after_forward(0);
    } else {
      l.alloc(hid);  // the received input
    }
    recs_.assign(static_cast<size_t>(stage_.end_layer), 0);
    for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i) {
      if (zero) zero->before_forward(static_cast<size_t>(i + 1));
      recs_[static_cast<size_t>(i)] = layer_forward(l, shapes_[static_cast<size_t>(i)]);
      if (zero) zero->after_forward(static_cast<size_t>(i + 1));
    }
    if (stage_.has_head) {
      if (zero) zero->before_forward(zero->head());
      if (zero && fused()) zero->before_backward(zero->head());
      head_rec_ = head_forward(l);
    } else {
      out_pending_ = hid;  // sent after the op
    }
  }
  void release_output(Ledger& l) {
    l.free(out_pending_);
    out_pending_ = 0;
  }

  // Backward of one micro-batch (with its weight work, or the input gradients only).
  void backward(Ledger& l, ZeroSim* zero, bool with_weight) {
    const int64_t hid = z_.T * z_.H * z_.s;  // the stream's gradient
    if (stage_.has_head) {
      if (zero && !fused()) zero->before_backward(zero->head());
      kept_ += head_backward(l, head_rec_, with_weight);
      if (zero) zero->after_backward(zero->head());
    } else {
      l.alloc(hid);  // the received output gradient
    }
    for (int64_t i = stage_.end_layer; i-- > stage_.first_layer;) {
      if (zero) zero->before_backward(static_cast<size_t>(i + 1));
      kept_ += layer_backward(l, shapes_[static_cast<size_t>(i)], recs_[static_cast<size_t>(i)], with_weight);
      if (zero) zero->after_backward(static_cast<size_t>(i + 1));
    }
    if (stage_.has_embedding && with_weight) {
      if (zero) zero->before_backward(0);
      if (zero) zero->after_backward(0);
    }
    l.free(hid);  // the input gradient (sent, or the embedding's, consumed)
  }

 private:
  bool fused() const { return z_.head_chunk > 0; }

  // Stage 1, 3 and 5 of the pre-norm layer (blocks/pre_norm_layer.cpp, attention.cpp, router.cpp, gated_mlp.cpp).
  // Returns the bytes the layer's record holds after its forward (its input included, its output not: same size).
  int64_t layer_forward(Ledger& l, const LayerShape& s) {
    const LayerBytes b(s, z_);
    const int64_t before = l.live;
    l.alloc(b.stat_t), l.alloc(b.hid);                  // rstd_input, normed_input
    l.alloc(b.q), l.alloc(b.kv), l.alloc(b.kv);         // q, k, v
    if (s.output_gate) l.alloc(2 * b.q), l.alloc(b.q);  // q_gate, gate
    if (s.qk_norm) l.alloc(b.q_stat), l.alloc(b.kv_stat);
    l.alloc(b.q), l.alloc(b.kv);                           // q_rot, k_rot
    l.alloc(b.q), l.alloc(b.q_stat);                       // attn, lse
    l.alloc(b.hid);                                        // the mixer's output (freed at the end of stage 1)
    if (s.output_gate) l.alloc(b.q);                       // gated
    l.alloc(b.stream), l.alloc(b.stat_t), l.alloc(b.hid);  // residual, rstd_post, normed_post
    if (s.moe) {
      l.alloc(2 * b.route_e), l.alloc(b.route_k_idx), l.alloc(b.route_k_stat), l.alloc(b.plan);  // routing
      l.alloc(b.aux);   // the router losses' d_probs, d_logits
      l.alloc(b.rows);  // the permuted rows (the expert MLP's input)
    }
    l.free(b.hid);                                        // the mixer's output
    l.alloc(b.gate_up), l.alloc(b.act), l.alloc(b.rows);  // stage 3: gate_up, act, y
    if (z_.recompute_activation) l.free(b.act);           // dropped once the down projection has read it
    l.alloc(b.stream);                                    // stage 5's output
    if (!s.moe) l.free(b.rows);                           // a dense layer keeps no combined rows
    return l.live - before;
  }

  // The layer's backward_input (and backward_weight); `g` (the incoming gradient, b.stream) is alive and is replaced
  // by the layer's input gradient. `rec` is what the record holds; returns what it holds after backward_input.
  int64_t layer_backward(Ledger& l, const LayerShape& s, int64_t rec, bool with_weight) {
    const LayerBytes b(s, z_);
    const bool cast = b.stream != b.hid;  // an f32 stream under bf16 compute
    if (!s.moe && cast) l.alloc(b.hid);   // stage 5: the incoming gradient's compute-dtype copy (the MLP's d_y)
    if (s.moe) {  // stage 5: d_combined (kept as the MLP's d_y), d_topk_weight; the combined rows are dropped
      l.alloc(b.rows), l.alloc(b.route_k_stat), l.free(b.rows);
      rec += b.route_k_stat;
    }
    // Stage 3: d_act (temporary), d_gate_up (kept), dx (the dispatched rows' gradient).
    l.alloc(b.act), l.alloc(b.gate_up), l.alloc(b.rows), l.free(b.act);
    rec += b.gate_up;
    if (z_.recompute_activation) l.alloc(b.act), rec += b.act;  // act recomputed for the weight gradient
    if (with_weight) {  // the MLP record: gate_up, act, d_gate_up and, for experts, the rows x and d_y
      const int64_t mlp = 2 * b.gate_up + b.act + (s.moe ? 2 * b.rows : 0);
      // Held for the step's end (GatedMlp::keep_for_weight_work drops gate_up only, and the rows x and d_y when the
      // layer holds their token-side sources instead): no longer the record's.
      const int64_t dropped = z_.held_rows_from_tokens ? b.gate_up + 2 * b.rows : b.gate_up;
      l.free(s.moe && z_.expert_weights_per_step ? dropped : mlp);
      rec -= mlp;
    }
    // Stage 1.
    if (s.moe) {
      l.alloc(b.stream);  // d_normed_post, summed in the stream's dtype
      l.alloc(b.route_e);
      rec += b.route_e;
      if (z_.c == 2) {  // the router's d_logits rounded to the compute dtype
        l.alloc(z_.T * z_.E * 2), l.free(b.route_e);
        rec += z_.T * z_.E * 2 - b.route_e;
      }
      l.alloc(b.hid);  // the router's input gradient (temporary)
    }
    l.alloc(b.stream);  // d_residual
    // The post-mixer norm's backward (input and weight gradients) has read d_normed_post: a MoE layer's goes, a dense
    // layer's is the MLP's dx, which the caller holds until the layer returns.
    if (s.moe) l.free(b.stream);
    if (cast) l.alloc(b.hid);  // its compute-dtype copy, kept as the attention's d_out
    l.alloc(b.q);              // d_attn
    rec += b.hid + b.q;
    if (s.output_gate) l.alloc(b.q), l.alloc(b.q);  // d_gated, d_gate (temporaries)
    l.alloc(b.q), l.alloc(b.kv), l.alloc(b.kv);     // d_q_rot, d_k_rot, d_v
    rec += b.q + 2 * b.kv;
    if (s.qk_norm) l.alloc(b.q), l.alloc(b.kv), rec += b.q + b.kv;  // d_q, d_k
    if (s.output_gate) l.alloc(2 * b.q), rec += 2 * b.q;            // d_q_proj
    l.alloc(b.hid), l.alloc(b.hid), l.free(b.hid);                  // dx (d_normed_input), partial
    if (s.output_gate) l.free(2 * b.q);  // d_gated, d_gate
    l.alloc(b.stream);                   // d_hidden: the new incoming gradient
    l.free(b.hid);                       // d_normed_input, read by the input norm's backward
    if (cast) l.free(b.stream);          // d_residual (the attention kept its copy)
    if (s.moe) {
      l.free(b.route_k_stat), l.free(b.hid), l.free(b.rows);  // d_topk_weight, the router's dx, d_dispatched
      rec -= b.route_k_stat;
    } else {
      l.free(b.rows);  // d_dispatched (the MLP's dx)
    }
    // The old incoming gradient: dropped, unless the dense MLP's record still holds it as d_y (no weight pass yet;
    // under an f32 stream the MLP holds a compute-dtype copy and the stream's gradient goes).
    if (s.moe || with_weight || cast) {
      l.free(b.stream);
    } else {
      rec += b.hid;
    }
    if (!s.moe && cast) {
      if (with_weight) {
        l.free(b.hid);
      } else {
        rec += b.hid;
      }
    }
    if (with_weight) {
      l.free(rec);
      return 0;
    }
    return rec;
  }

  int64_t head_forward(Ledger& l) {
    const int64_t hid = z_.T * z_.H * z_.c;
    const int64_t stream = z_.T * z_.H * z_.s;
    const int64_t before = l.live;
    l.alloc(z_.T * kStat), l.alloc(hid), l.alloc(2 * z_.T * kStat);  // rstd, normed, losses, lse
    if (!fused()) {
      l.alloc(z_.T * z_.V * z_.c);  // logits
    } else {
      l.alloc(hid);  // d_normed
      const int64_t width = std::min(z_.head_chunk, z_.V);
      const int64_t work = 3 * z_.T * kStat + z_.T * width * z_.c + (z_.c == 2 ? z_.T * z_.H * 4 : 0);
      l.alloc(work), l.free(work);  // row statistics, the chunk's logits, the f32 dx accumulator
    }
    return l.live - before + stream;  // the record holds the last layer's output too
  }

  int64_t head_backward(Ledger& l, int64_t rec, bool with_weight) {
    const int64_t hid = z_.T * z_.H * z_.c;
    const int64_t stream = z_.T * z_.H * z_.s;
    if (!fused()) l.alloc(hid), rec += hid;  // d_normed (the logits' gradient overwrites the logits in their buffer)
    l.alloc(stream);                          // d_hidden
    l.free(hid), rec -= hid;                  // d_normed, read by the final norm's backward
    if (with_weight) {
      l.free(rec);
      return 0;
    }
    return rec;
  }

 private:
  const std::vector<LayerShape>& shapes_;
  Sizes z_;
  pipeline::StageLayers stage_;
  int64_t out_pending_ = 0;
  std::vector<int64_t> recs_;
  int64_t head_rec_ = 0;
  int64_t kept_ = 0;  // what backward_input left for the weight pass
};

struct StageProfile {
  int64_t f_retained = 0, f_peak = 0;  // after / during a forward, from an empty ledger
  int64_t b_peak = 0;                  // during a full backward, above the base before it (the record included)
  int64_t bi_peak = 0, bi_kept = 0;    // backward_input: peak above the base, and what stays for the weight pass
};

StageProfile profile_stage(const std::vector<LayerShape>& shapes, const Sizes& z, const pipeline::StageLayers& stage) {
  StageProfile p;
  {
    StageSim sim(shapes, z, stage);
    Ledger l;
    sim.forward(l, nullptr);
    sim.release_output(l);
    p.f_retained = l.live;
    p.f_peak = l.peak;
    Ledger b;
    b.live = b.peak = p.f_retained;
    sim.backward(b, nullptr, true);
    p.b_peak = b.peak - p.f_retained;
  }
  {
    StageSim sim(shapes, z, stage);
    Ledger l;
    sim.forward(l, nullptr);
    sim.release_output(l);
    Ledger b;
    b.live = b.peak = l.live;
    sim.backward(b, nullptr, false);
    p.bi_peak = b.peak - l.live;
    p.bi_kept = b.live;
  }
  return p;
}

int64_t micro_batches_for(const io::TrainSection& train) {
  if (train.global_batch_tokens > 0) return train.global_batch_tokens / (train.micro_batch * train.seq_len);
  return std::max<int64_t>(train.global_batch, train.micro_batch) / train.micro_batch;
}

}  // namespace

std::string format_size(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (std::llabs(bytes) >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  return fmt::format("{:.2f} MiB", b / (1 << 20));
}

MemoryPlan plan_memory(const io::JobConfig& config, int world) {
  MT_CHECK(world >= 1, "plan: --world must be >= 1 but is {}", world);
  const model::ModelConfig mc = model::load_model_config(config.model.config);
  const dist::MeshShape shape =
      dist::resolve_mesh(world, static_cast<int>(config.parallel.pp), static_cast<int>(config.parallel.cp),
                         static_cast<int>(config.parallel.ep), mc.num_experts);
  const std::vector<model::ParamSpec> specs = mc.family->param_specs(mc);
  const bool bf16 = config.model.compute_dtype == "bf16";
  const int64_t moment_bytes = config.optim.state_dtype == "bf16" ? 2 : 4;
  const int64_t c = bf16 ? 2 : 4;
  const int data_ranks = shape.dp * shape.ep;
  const bool dualpipev = shape.pp > 1 || config.parallel.schedule == "dualpipev";
  MT_CHECK(world > 1 || config.parallel.schedule != "dualpipev",
           "plan: parallel.schedule = dualpipev runs over a mesh, which one process alone does not build; plan it on "
           "--world >= 2 ranks");
  const bool sharded = config.parallel.sharding == "full" || (config.parallel.sharding == "auto" && data_ranks > 1 &&
                                                              shape.pp == 1 && config.parallel.schedule == "auto");
  MT_CHECK(!sharded || shape.pp == 1, "plan: parallel.sharding = full runs with pp = 1; the mesh is {}", shape.str());
  MT_CHECK(
      !sharded || config.model.expert_weight_gradient != "step",
      "plan: model.expert_weight_gradient = step holds every micro-batch's expert rows until the step's end, which "
      "ZeRO-3 frees per layer; parallel.sharding = {} shards over the {} data ranks: set parallel.sharding = none, "
      "or use micro_batch",
      config.parallel.sharding, data_ranks);
  MT_CHECK(!sharded || !dualpipev,
           "plan: parallel.sharding = full runs on the plain executor; parallel.schedule = dualpipev is not supported "
           "with it");

  MemoryPlan plan;
  plan.mesh = shape.str();
  plan.world = world;
  plan.executor = dualpipev ? "DualPipeV" : "plain";
  plan.sharding = sharded
                      ? (config.parallel.reduce_gradients == "step" ? "ZeRO-3 (gradients reduced per step)" : "ZeRO-3")
                      : "replicated";
  plan.compute_dtype = config.model.compute_dtype;
  plan.state_dtype = config.optim.state_dtype;
  for (const auto& s : specs) plan.total_parameters += shape_numel(s.shape);
  const int64_t total_micro = micro_batches_for(config.train);
  MT_CHECK(total_micro % data_ranks == 0,
           "plan: the global batch holds {} micro-batches, which the {} data-parallel ranks cannot share evenly (make "
           "train.global_batch / train.micro_batch a multiple of {})",
           total_micro, data_ranks, data_ranks);
  const int64_t n = total_micro / data_ranks;
  MT_CHECK(!dualpipev || n >= 2 * shape.pp,
           "plan: DualPipeV over pp = {} ranks needs >= 2 * pp = {} micro-batches per step per pipeline, but each gets "
           "{}; raise train.global_batch or lower parallel.pp",
           shape.pp, 2 * shape.pp, n);
  plan.tokens_per_micro_batch = config.train.micro_batch * config.train.seq_len;
  plan.micro_batches_per_rank = n;
  plan.tokens_per_step = plan.tokens_per_micro_batch * total_micro;
  plan.flops_per_token = model::training_flops_per_token(mc, config.train.seq_len);
  plan.flops_per_step = plan.flops_per_token * static_cast<double>(plan.tokens_per_step);

  Sizes z;
  z.T = plan.tokens_per_micro_batch;
  z.H = mc.hidden_size;
  z.V = mc.vocab_size;
  z.E = mc.num_experts;
  z.K = mc.num_experts_per_tok;
  z.c = c;
  z.s = config.model.residual_dtype == "f32" ? 4 : c;
  z.recompute_activation = config.model.recompute == "activation";
  z.expert_weights_per_step = config.model.expert_weight_gradient == "step";
  z.held_rows_from_tokens = z.expert_weights_per_step && shape.ep == 1;
  z.router_aux = mc.is_moe() && (config.loss.load_balance_coef > 0.0 || config.loss.z_loss_coef > 0.0 ||
                                 config.loss.device_balance_coef > 0.0);
  z.head_chunk = config.model.head_chunk;
  std::vector<LayerShape> shapes;
  bool modeled = true;
  std::string why;
  for (int64_t i = 0; i < mc.num_hidden_layers; ++i) {
    shapes.push_back(mc.family->layer_activation_shape(mc, i));
    if (!shapes.back().not_modeled.empty() && modeled) {
      modeled = false, why = fmt::format("layer {}: {}", i, shapes.back().not_modeled);
    }
  }
  const int64_t batch_bytes = n * 3 * z.T * kIndex * (bf16 ? 2 : 1);  // input_ids, targets, position_ids (+ device)

  // The long-lived tensors of a rank holding the whole model (replicated data parallelism, every pp rank).
  const bool tied = std::none_of(specs.begin(), specs.end(),
                                 [](const model::ParamSpec& s) { return s.role == model::ParamRole::Head; });
  // An f32 stream reads an untied embedding from its master: no copy (CausalLm::set_stream_dtype).
  const bool master_table = z.s == 4 && !tied;
  const auto copy_of = [&](const model::ParamSpec& s) {
    const bool table = s.role == model::ParamRole::Embedding && s.layer < 0;
    return bf16 && s.is_matrix() && !s.f32_compute && !(table && master_table);
  };
  int64_t full_weights = 0, full_params = 0;
  for (const auto& s : specs) {
    const int64_t numel = shape_numel(s.shape);
    full_params += numel;
    if (copy_of(s)) full_weights += numel * 2;
  }

  if (sharded) {
    // Every tensor sharded over dp x ep (an expert bank over dp, this ep rank's experts only).
    std::vector<ZeroPart> parts(static_cast<size_t>(mc.num_hidden_layers + 2));
    RankMemory r;
    r.label = "every rank";
    r.ranks = world;
    for (const auto& s : specs) {
      const int64_t numel = shape_numel(s.shape);
      const bool split = s.role == model::ParamRole::ExpertBank && shape.ep > 1;
      const int64_t group = split ? numel / shape.ep : numel;
      const int64_t ranks = split ? shape.dp : data_ranks;
      const int64_t shard = (group + ranks - 1) / ranks;
      // The gathered storage spans the whole tensor, padded past the (last) group's end (dist/sharded_parameters.h).
      const int64_t padded = numel - group + ranks * shard;
      r.held_parameters += shard;
      r.masters += shard * 4;
      r.gradients += shard * 4;
      r.optimizer += 2 * shard * moment_bytes;
      if (copy_of(s)) r.weights += shard * 2;
      ZeroPart& part = parts[s.layer >= 0 ? static_cast<size_t>(s.layer + 1)
                                          : (s.role == model::ParamRole::Embedding ? 0 : parts.size() - 1)];
      part.gathered += padded * (copy_of(s) ? 2 : 4);
      part.full_grad += padded * 4;
      part.shard_grad += shard * 4;
    }
    r.owned_parameters = r.held_parameters;
    pipeline::StageLayers whole;
    whole.first_layer = 0;
    whole.end_layer = mc.num_hidden_layers;
    whole.has_embedding = whole.has_final_norm = whole.has_head = true;
    const bool every = config.parallel.reduce_gradients != "step";
    Ledger l;
    ZeroSim zero(l, parts, every, n, tied, config.model.device == "cpu");
    StageSim sim(shapes, z, whole);
    int64_t retained = 0;
    for (int64_t mb = 0; mb < n; ++mb) {
      const int64_t before = l.live;
      sim.forward(l, &zero);
      retained = std::max(retained, l.live - before);
      sim.backward(l, &zero, true);
    }
    const StageProfile prof = profile_stage(shapes, z, whole);
    r.activations_per_micro_batch = prof.f_retained;
    r.micro_batches_alive = 1.0;
    r.activations = prof.f_retained;
    r.workspace = l.peak - prof.f_retained + batch_bytes;
    r.step_peak = r.weights + r.masters + r.optimizer + r.gradients + r.activations + r.workspace;
    // Start-up: the whole model (masters, compute copies, gradients) before it is sharded.
    r.startup_peak = full_params * 8 + full_weights;
    r.activations_modeled = modeled;
    r.note = modeled ? "" : "activations not modeled (" + why + ")";
    plan.ranks.push_back(r);
    return plan;
  }

  // Replicated: every rank holds the whole model, its gradients and its moments (under pipeline parallelism too:
  // each pp rank updates only its stages' parameters but allocates every one).
  const auto whole_static = [&](RankMemory& r) {
    r.held_parameters = full_params;
    r.weights = full_weights;
    r.masters = full_params * 4;
    r.gradients = full_params * 4;
    r.optimizer = full_params * 2 * moment_bytes;
    r.startup_peak = r.weights + r.masters + r.gradients + r.optimizer;
    r.activations_modeled = modeled;
    r.note = modeled ? "" : "activations not modeled (" + why + ")";
  };

  if (!dualpipev) {
    RankMemory r;
    r.label = world == 1 ? "the one rank" : "every rank";
    r.ranks = world;
    whole_static(r);
    r.owned_parameters = full_params;
    pipeline::StageLayers whole;
    whole.first_layer = 0;
    whole.end_layer = mc.num_hidden_layers;
    whole.has_embedding = whole.has_final_norm = whole.has_head = true;
    const StageProfile prof = profile_stage(shapes, z, whole);
    r.activations_per_micro_batch = prof.f_retained;
    r.micro_batches_alive = 1.0;
    r.activations = prof.f_retained;
    // model.expert_weight_gradient = step: each micro-batch's backward leaves its expert rows held (x, d_y, act,
    // d_gate_up a MoE layer; with ep = 1 instead of x and d_y their sources: the normed tokens, the output's
    // gradient in the stream's dtype, the routing weights and plan) under the later micro-batches; at the step's end
    // each layer concatenates them, a pair of [all rows, .] tensors at a time (GatedMlp::backward_weight_together).
    int64_t held = 0, widest_pair = 0;
    if (z.expert_weights_per_step) {
      for (const LayerShape& s : shapes) {
        if (!s.moe) continue;
        const LayerBytes b(s, z);
        const int64_t rows = z.held_rows_from_tokens ? b.hid + b.stream + b.route_k_stat + b.plan : 2 * b.rows;
        held += rows + b.act + b.gate_up;
        widest_pair = std::max(widest_pair, std::max(b.rows + b.act, b.gate_up + b.rows));
      }
    }
    const int64_t step_end = n * (held + widest_pair);
    r.workspace = std::max(std::max(prof.f_peak, prof.f_retained + prof.b_peak) + (n - 1) * held, step_end) -
                  prof.f_retained + batch_bytes;
    r.step_peak = r.startup_peak + r.activations + r.workspace;
    plan.ranks.push_back(r);
    return plan;
  }

  // DualPipeV: walk each rank's op list; records of (chunk, micro-batch) stay alive from their forward to their
  // backward (full) or their deferred weight work.
  const pipeline::Partition partition = job_partition(config, mc, shape.pp);
  for (int rank = 0; rank < shape.pp; ++rank) {
    RankMemory r;
    const pipeline::StageLayers& down = partition.down_stage(rank);
    const pipeline::StageLayers& up = partition.up_stage(rank);
    r.label = fmt::format("pp rank {} (stages {} and {}: layers [{}, {}) and [{}, {}){}{})", rank, down.stage, up.stage,
                          down.first_layer, down.end_layer, up.first_layer, up.end_layer,
                          down.has_embedding ? ", embedding" : "", up.has_head ? ", head" : "");
    r.ranks = world / shape.pp;
    whole_static(r);
    for (const auto& s : specs) {
      const bool mine = s.layer < 0 ? rank == 0
                                    : (s.layer >= down.first_layer && s.layer < down.end_layer) ||
                                          (s.layer >= up.first_layer && s.layer < up.end_layer);
      if (mine) r.owned_parameters += shape_numel(s.shape);
    }
    const StageProfile prof[2] = {profile_stage(shapes, z, down), profile_stage(shapes, z, up)};
    int64_t alive = 0, peak = 0, alive_records = 0, records_at_peak = 0, alive_at_peak = 0;
    std::deque<int64_t> weight_queue;
    const auto at = [&](int64_t candidate) {
      if (candidate > peak) peak = candidate, records_at_peak = alive_records, alive_at_peak = alive;
    };
    for (const pipeline::PipelineOp& op : pipeline::dualpipev_schedule(shape.pp, rank, static_cast<int>(n))) {
      switch (op.kind) {
        case pipeline::OpKind::Forward: {
          const StageProfile& p = prof[op.forward.chunk];
          at(alive + p.f_peak);
          alive += p.f_retained, ++alive_records;
          break;
        }
        case pipeline::OpKind::BackwardFull: {
          const StageProfile& p = prof[op.backward.chunk];
          at(alive + p.b_peak);
          alive -= p.f_retained, --alive_records;
          break;
        }
        case pipeline::OpKind::BackwardInput: {
          const StageProfile& p = prof[op.backward.chunk];
          at(alive + p.bi_peak);
          alive += p.bi_kept - p.f_retained;
          weight_queue.push_back(p.bi_kept);
          break;
        }
        case pipeline::OpKind::Weight: {
          MT_CHECK(!weight_queue.empty(), "plan: a DualPipeV weight op with no deferred backward");
          alive -= weight_queue.front(), --alive_records;
          weight_queue.pop_front();
          break;
        }
        case pipeline::OpKind::OverlappedPair: {
          const StageProfile& f = prof[op.forward.chunk];
          const StageProfile& b = prof[op.backward.chunk];
          at(std::max(alive + f.f_peak, alive + f.f_retained + b.b_peak));
          alive += f.f_retained - b.f_retained;
          break;
        }
      }
    }
    r.activations_per_micro_batch = prof[0].f_retained + prof[1].f_retained;
    // The (stage, micro-batch) records alive when the peak op starts (two make one micro-batch on this rank), and
    // the op's own transient on top of them.
    r.micro_batches_alive = 0.5 * static_cast<double>(records_at_peak);
    r.activations = alive_at_peak;
    r.workspace = peak - alive_at_peak + batch_bytes;
    r.step_peak = r.startup_peak + peak + batch_bytes;
    plan.ranks.push_back(r);
  }
  return plan;
}

std::string format_memory_plan(const MemoryPlan& plan) {
  std::string out;
  out += fmt::format("mesh {} ({} ranks), {} executor, {}, {} compute\n", plan.mesh, plan.world, plan.executor,
                     plan.sharding, plan.compute_dtype);
  out += fmt::format("model: {} parameters ({:.3f} B)\n", plan.total_parameters,
                     static_cast<double>(plan.total_parameters) / 1e9);
  out += fmt::format("step: {} micro-batches of {} tokens per data-parallel replica, {} tokens over the mesh\n",
                     plan.micro_batches_per_rank, plan.tokens_per_micro_batch, plan.tokens_per_step);
  out += fmt::format("FLOPs (model, forward + backward): {:.4g} per token, {:.4g} per step ({:.4g} TFLOP)\n",
                     plan.flops_per_token, plan.flops_per_step, plan.flops_per_step / 1e12);
  for (const RankMemory& r : plan.ranks) {
    out += fmt::format("\n{} (x{}): {} parameters held, {} updated\n", r.label, r.ranks, r.held_parameters,
                       r.owned_parameters);
    const auto row = [&](const std::string& name, int64_t bytes, const std::string& note = "") {
      out += fmt::format("  {:<34} {:>12}{}\n", name, format_size(bytes), note.empty() ? "" : "  " + note);
    };
    row("compute weights (bf16 copies)", r.weights,
        plan.compute_dtype == "bf16" ? "" : "(f32: compute reads the masters)");
    row("fp32 masters", r.masters);
    row(fmt::format("AdamW moments (2 x {})", plan.state_dtype), r.optimizer);
    row("gradients (fp32)", r.gradients);
    row("activations per micro-batch", r.activations_per_micro_batch);
    row("activations at the peak", r.activations,
        fmt::format("({:.1f} micro-batches' records alive)", r.micro_batches_alive));
    row("workspace at the peak", r.workspace, "(head/loss, backward temporaries, batch, gathered weights)");
    row("step peak", r.step_peak);
    row("start-up peak", r.startup_peak);
    row("predicted peak", r.peak());
    if (!r.note.empty()) out += "  note: " + r.note + "\n";
  }
  return out;
}

}  // namespace moetrain::train
