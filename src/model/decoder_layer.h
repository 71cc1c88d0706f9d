// defines: the five-stage decoder-layer contract the pipeline engine sees (docs/design.md section 4).
// Stage 1 (token mixing + router), stage 3 (experts), stage 5 (aggregate) belong to the layer; stages 2 (dispatch)
// and 4 (combine) belong to the engine, which moves stage 1's rows to the ranks holding their experts and stage 3's
// outputs back; without expert parallelism they pass through. Dense layers run their MLP as stage 3 on the normed
// tokens and route nothing.
// The layer's record of one micro-batch is its own: the engine holds it (LayerRecord) without looking inside, and
// sees only what stages 2 and 4 need (Dispatch) and the router's metrics. So stage 1 may hold attention, latent
// attention or linear attention, and stage 5 a shared expert, without an executor changing.
// Each stage's backward is split: backward_input (activation gradients, on the critical path) and backward_weight
// (weight gradients, deferrable); the record lives from stage 1's forward to the last backward_weight.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/batch.h"
#include "model/router_loss.h"

namespace moetrain::model {

// What stage 1 hands to the engine's dispatch (stage 2).
struct Dispatch {
  Tensor rows;           // [R, H] rows for stage 3: expert-ordered token copies, or the T normed tokens (dense)
  Tensor group_offsets;  // i32 [E + 1] rows per expert of `rows`; undefined for a dense layer
  Tensor row_choice;     // i32 [R] the flat choice t * K + k each row holds (routed layers)
  Tensor topk_index;     // i32 [T, K] the router's choices (routed layers)
  bool routed() const { return group_offsets.defined(); }
};

// One layer's record of one micro-batch. Families derive their own; the engine reads only these two fields.
struct LayerRecord {
  virtual ~LayerRecord() = default;
  // The auxiliary router losses of this micro-batch when its batch asks for them (MoE layers), and the router
  // logits [T, E] (for observers: check-golden compares them with HF's); both empty for dense layers.
  RouterLossValues aux;
  Tensor router_logits;
};

class DecoderLayer {
 public:
  virtual ~DecoderLayer() = default;

  virtual int64_t index() const = 0;
  virtual bool has_experts() const = 0;
  // "" when stage 1 takes a generation call (model/decode_cache.h), else what it lacks.
  virtual std::string decoding_support() const = 0;

  virtual std::unique_ptr<LayerRecord> new_record() const = 0;
  // Recompute the gated MLPs' activations in the backward instead of keeping them (GatedMlp). Set before a step.
  virtual void set_recompute_activation(bool on) = 0;

  virtual Dispatch stage1_forward(LayerRecord& record, const Tensor& hidden, const MicroBatch& batch) const = 0;
  // rows and group_offsets: stage 1's, or what the dispatch delivered (this rank's experts' rows).
  virtual Tensor stage3_forward(LayerRecord& record, const Tensor& rows, const Tensor& group_offsets) const = 0;
  // combined: stage 3's output rows as they came back (stage 4). Returns the layer output [T, H].
  virtual Tensor stage5_forward(LayerRecord& record, const Tensor& combined) const = 0;

  // Returns the gradient of stage 3's output rows.
  virtual Tensor stage5_backward_input(LayerRecord& record, const Tensor& d_out) const = 0;
  // Returns the gradient of stage 3's input rows.
  virtual Tensor stage3_backward_input(LayerRecord& record, const Tensor& d_combined) const = 0;
  virtual void stage3_backward_weight(LayerRecord& record) const = 0;
  // Stage 3's weight work held past its micro-batch (an executor that runs the expert weight gradients once a step):
  // moves what stage3_backward_weight reads out of `record` (whose stage-1 weight work then frees the rest) into a
  // record of its own, for stage3_backward_weight_together. `own_rows`: stage 3 ran on stage 1's own rows (no expert
  // exchange between); called so before stage1_backward_input, the layer may hold what it made those rows and their
  // gradient from instead of the rows themselves.
  virtual std::unique_ptr<LayerRecord> take_stage3_weight_work(LayerRecord& record, bool own_rows) const = 0;
  // Stage 3's weight gradients of several micro-batches from the records take_stage3_weight_work made, in micro-batch
  // order: an expert bank's in one grouped GEMM per weight over all their rows. Their sum over the micro-batches, in
  // another f32 summation order than stage3_backward_weight's one by one. Frees what the records hold.
  virtual void stage3_backward_weight_together(const std::vector<LayerRecord*>& records) const = 0;
  // Returns d_hidden from the gradient of stage 1's dispatched rows (and what stage 5's backward kept).
  virtual Tensor stage1_backward_input(LayerRecord& record, const Tensor& d_dispatched) const = 0;
  virtual void stage1_backward_weight(LayerRecord& record) const = 0;
};

}  // namespace moetrain::model
