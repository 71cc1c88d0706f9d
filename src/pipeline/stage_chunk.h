// defines: StageChunk, the one layer driver: the work of one pipeline stage (a contiguous run of decoder layers, plus
// the embedding on the first stage and the final norm, head and loss on the last) for the micro-batches in flight,
// with a record per micro-batch that lives from its forward to its backward_weight. Every executor runs it: the plain
// executor (one stage holding the whole model), DualPipeV's stage chunks and the forward pipeline, so a result never
// depends on which executor ran it. The layers' records are opaque here (model/decoder_layer.h): the chunk sees only
// the rows stage 1 hands to the dispatch, and the router's metrics. Work is cut into stage-sized steps so that the
// executor can interleave the forward of one micro-batch with the backward of another (DualPipe's overlapped pair).
// With an ep communicator, stages 2 and 4 of the MoE layers are expert parallelism's dispatch and combine
// (pipeline/expert_exchange.h), as in PlainExecutor. In exact mode (CausalLm::set_exact) the hidden state is rounded to
// bf16 after the embedding and after every layer, as PlainExecutor and model::forward_backward do.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/decoder_layer.h"
#include "model/router_loss.h"
#include "pipeline/parameter_hooks.h"
#include "pipeline/partition.h"

namespace moetrain::pipeline {

// One step of a chunk's forward or backward for one micro-batch: one stage of one layer, the embedding or the
// head. `communication` marks stages 2 and 4 (the expert-parallel dispatch and combine and their backwards): they
// pass the rows through without an ep communicator, and they are what a GPU executor puts on its communication
// stream.
struct ChunkStep {
  std::string label;  // "F mb3 L5 s1", "B mb2 head", ... (traces and test messages)
  bool communication = false;
  std::function<void()> run;
};

// What a chunk's forward of one micro-batch produced.
struct ChunkForward {
  Tensor hidden;  // [T, H] the stage output; undefined on the loss stage
  // The loss stage only: cross-entropy sum and counted targets, pending on CUDA until model::resolve_losses.
  model::LossSum loss;
  // The auxiliary router losses of the chunk's MoE layers for this micro-batch: (global layer index, values).
  std::vector<std::pair<int64_t, model::RouterLossValues>> router_losses;
  // The loss stage only, for a forward alone (loss scale 0) or under set_observe: f32 [T] on the CPU, log p(target[t])
  // from the head's per-token losses (+0.0f where the target is ignored: model::token_logprobs_from_losses).
  Tensor token_logprobs;
  // With set_observe(true): the logits [T, V] (loss stage) and the router logits [T, E] of the chunk's MoE layers.
  Tensor logits;
  std::vector<Tensor> router_logits;
};

class StageChunk {
 public:
  // `model` must outlive the chunk; the chunk computes with (and accumulates into the gradients of) the layers of
  // `stage` only. `ep` (may be null; must outlive the chunk): the expert-parallel group of this pipeline rank. Then
  // every MoE layer's stage 2 plans the exchange (pipeline/expert_exchange.h: each token sent once per destination
  // rank; kept from the forward to the backward) and dispatches the rows to their experts' ranks, stage 3 computes this
  // rank's E / ep experts, stage 4 combines; the backward runs combine_backward and dispatch_backward. These are
  // collectives over `ep`: the ep peers of a pipeline rank must run the same steps (same chunks, layers and micro-batch
  // ids) in the same order. The executors guarantee it: the peers walk the same op list (the schedule depends only on
  // pp, the rank and the micro-batch count, which must be the same on every ep rank) with the same interleaving of
  // steps.
  StageChunk(const model::CausalLm& model, const StageLayers& stage, dist::Communicator* ep = nullptr);
  ~StageChunk();
  StageChunk(const StageChunk&) = delete;
  StageChunk& operator=(const StageChunk&) = delete;

  const StageLayers& stage() const { return stage_; }
  bool is_loss_stage() const { return stage_.has_head; }
  bool has_embedding() const { return stage_.has_embedding; }

  // Whole calls. `input` is the previous stage's output (ignored and may be undefined on the embedding stage,
  // which reads batch.input_ids); `batch` carries the metadata (cu_seqlens, position_ids; targets on the loss
  // stage) and must stay as given until the micro-batch's backward_weight ran (the chunk keeps a copy).
  // `loss_scale` (loss stage): 1 / the step's global target count when a backward follows, which the fused head
  // needs up front (model::CausalLm::head_forward); 0 for a forward alone. Other stages ignore it.
  ChunkForward forward(int microbatch, const model::MicroBatch& batch, const Tensor& input, double loss_scale);
  // Activation gradients only; the weight work is kept for backward_weight. `d_output` is the gradient of the
  // stage output (undefined on the loss stage, whose backward starts from d(loss)/d(ce_sum) = loss_scale).
  // Returns the gradient of the stage input (undefined on the embedding stage).
  Tensor backward_input(int microbatch, const Tensor& d_output, double loss_scale);
  // The weight gradients of a micro-batch whose backward_input ran; frees its records.
  void backward_weight(int microbatch);
  // backward_input and backward_weight together (the weight work of each stage right after its input work).
  Tensor backward_full(int microbatch, const Tensor& d_output, double loss_scale);

  // The same work as steps. plan_* creates the micro-batch's record (checks run here, before any step) and
  // returns steps that must run in order; finish_* then returns the result. An executor may interleave the steps
  // of two plans on different micro-batches.
  std::vector<ChunkStep> plan_forward(int microbatch, const model::MicroBatch& batch, const Tensor& input,
                                      double loss_scale);
  ChunkForward finish_forward(int microbatch);
  std::vector<ChunkStep> plan_backward(int microbatch, const Tensor& d_output, double loss_scale, bool with_weight);
  Tensor finish_backward(int microbatch);

  // Frees the records of a micro-batch whose forward finished, without a backward (a forward-only pass).
  void drop(int microbatch);

  // Whether the expert dispatch sends each token once per destination rank (default) or every (token, expert)
  // row (ExpertExchange::create).
  void set_expert_deduplication(bool on) { deduplicate_ = on; }

  // Micro-batches whose records are held (forward ran, backward_weight not yet).
  int64_t live_records() const { return static_cast<int64_t>(states_.size()); }
  // Keep the router logits in each ChunkForward and, with `logits`, the logits too (the head then materialises them,
  // which changes the head's program when the vocabulary spans several chunks): check-golden, tests.
  void set_observe(bool on, bool logits = true) {
    observe_ = on;
    observe_logits_ = on && logits;
  }
  // Called around each part of the model the chunk runs (ZeRO-3 gathers and frees parameters there:
  // train/fully_sharded.h); null: none. With hooks, backwards must run their weight work at once (backward_full).
  void set_parameter_hooks(ParameterHooks* hooks) { hooks_ = hooks; }
  // Hold the MoE layers' stage-3 weight work of every micro-batch whose backward runs its weight work, instead of
  // running it then (DecoderLayer::take_stage3_weight_work), until finish_expert_weights runs it for all of them at
  // once (stage3_backward_weight_together: an expert bank's weight gradients in one grouped GEMM each over all the
  // micro-batches' rows). Refused with parameter hooks (ZeRO-3 frees a layer's gradients after its backward).
  void set_expert_weights_per_step(bool on);
  // Runs the held stage-3 weight work, layer by layer, micro-batches in the order their backwards ran; nothing when
  // none is held. An executor calls it once every backward of the step has run.
  void finish_expert_weights();
  // Drops every record (after a failed step).
  void clear();

 private:
  struct LayerState;
  struct MicroBatchState;

  MicroBatchState& state(int microbatch, const char* what);
  void run_weight_work(MicroBatchState& st);
  // Stage 3's weight work of layer i of the stage: now, or held for finish_expert_weights.
  void stage3_weight_work(int64_t i, LayerState& ls);

  // Stages 2 and 4 of a layer: the expert-parallel dispatch and combine (and their backwards). Without an ep
  // communicator, or for a dense layer, they pass the rows through unchanged.
  void expert_dispatch(LayerState& ls) const;
  void expert_combine(LayerState& ls) const;
  void expert_combine_backward(LayerState& ls) const;
  void expert_dispatch_backward(LayerState& ls) const;
  // The exchange's communication stream, ordered after the compute queued so far; await_exchange makes compute wait
  // for it before a step reads what the exchange produced.
  Stream& begin_exchange(LayerState& ls) const;
  void await_exchange(LayerState& ls) const;

  const model::CausalLm& model_;
  StageLayers stage_;
  dist::Communicator* ep_ = nullptr;
  bool deduplicate_ = true;
  bool observe_ = false;
  bool observe_logits_ = false;
  ParameterHooks* hooks_ = nullptr;
  bool expert_weights_per_step_ = false;
  // The held stage-3 weight work of each MoE layer of the stage (by its index in the stage), in backward order.
  std::map<int64_t, std::vector<std::unique_ptr<model::LayerRecord>>> held_expert_weights_;
  std::map<int, std::unique_ptr<MicroBatchState>> states_;  // stable addresses: records point into the batch
};

}  // namespace moetrain::pipeline
