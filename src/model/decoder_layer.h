// defines: the five-stage decoder-layer contract the pipeline engine sees (DESIGN.md section 4).
// Stage 1 attention + router, stage 3 experts, stage 5 aggregate belong to the layer; stages 2
// (dispatch) and 4 (combine) belong to the engine, which moves stage 1's `dispatched` rows to the
// ranks holding their experts and stage 3's outputs back. Without expert parallelism they pass
// through. Dense layers run their MLP as stage 3 on the normed tokens and leave routing empty.
// Each stage's backward is split: backward_input (activation gradients, on the critical path) and
// backward_weight (weight gradients, deferrable); a record lives from a stage's forward to its
// backward_weight, which frees it.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "model/attention_block.h"
#include "model/batch.h"
#include "model/mlp_block.h"
#include "model/router_block.h"
#include "model/router_loss.h"

namespace moetrain::model {

struct Stage1Out {
  Tensor residual;          // [T, H] hidden + attention: the residual stage 5 adds to
  Tensor dispatched;        // [R, H] rows for stage 3 (expert-ordered token copies, or the T normed tokens)
  Tensor group_offsets;     // i32 [E + 1] rows per expert of `dispatched`; undefined for dense layers
  RoutingMetadata routing;  // empty for dense layers
};

struct Stage5Grads {
  Tensor d_residual;     // [T, H]
  Tensor d_combined;     // [R, H] gradient of stage 3's output rows
  Tensor d_topk_weight;  // [T, K] for MoE layers; undefined for dense
};

struct Stage1Record {
  Tensor hidden, rstd_input, normed_input;
  AttentionRecord attention;
  Tensor residual, rstd_post, normed_post;
  RouterRecord router;
  RoutingMetadata routing;
  // Auxiliary router losses of this micro-batch (when its batch asks for them): their values and
  // the gradients stage 1's backward injects on the probabilities and on the logits.
  RouterLossValues aux;
  Tensor d_probs, d_logits;
  // Kept by backward_input for backward_weight.
  Tensor d_normed_input, d_normed_post;
};

struct Stage3Record {
  MlpRecord mlp;
};

struct Stage5Record {
  Tensor combined;  // stage 3 output rows as they came back
  RoutingMetadata routing;
};

// All three records of one layer, for the whole-layer reference path.
struct LayerRecord {
  Stage1Record stage1;
  Stage3Record stage3;
  Stage5Record stage5;
  Stage1Out stage1_out;
};

class DecoderLayer {
 public:
  virtual ~DecoderLayer() = default;

  virtual int64_t index() const = 0;
  virtual bool has_experts() const = 0;
  // Position among the model's MoE layers (0, 1, ...); -1 for a dense layer.
  virtual int64_t moe_index() const = 0;

  virtual Stage1Out stage1_forward(Stage1Record& record, const Tensor& hidden, const MicroBatch& batch) const = 0;
  virtual Tensor stage3_forward(Stage3Record& record, const Tensor& dispatched, const Tensor& group_offsets) const = 0;
  virtual Tensor stage5_forward(Stage5Record& record, const Tensor& combined, const Stage1Out& stage1) const = 0;

  virtual Stage5Grads stage5_backward_input(Stage5Record& record, const Tensor& d_out) const = 0;
  virtual Tensor stage3_backward_input(Stage3Record& record, const Tensor& d_combined) const = 0;
  virtual void stage3_backward_weight(Stage3Record& record) const = 0;
  // Returns d_hidden from the stage-5 gradients and the gradient of stage 1's dispatched rows.
  virtual Tensor stage1_backward_input(Stage1Record& record, const Stage5Grads& grads,
                                       const Tensor& d_dispatched) const = 0;
  virtual void stage1_backward_weight(Stage1Record& record) const = 0;

  // The whole layer with stages 2 and 4 passing through: no pipeline, no overlap (tests, the
  // plain executor's single-rank path).
  Tensor reference_forward(LayerRecord& record, const Tensor& hidden, const MicroBatch& batch) const;
  // Input and weight gradients together; returns d_hidden.
  Tensor reference_backward(LayerRecord& record, const Tensor& d_out) const;
};

}  // namespace moetrain::model
