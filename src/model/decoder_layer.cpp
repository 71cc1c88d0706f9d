// defines: the whole-layer reference path over the five-stage contract.
#include "model/decoder_layer.h"

namespace moetrain::model {

Tensor DecoderLayer::reference_forward(LayerRecord& r, const Tensor& hidden, const MicroBatch& batch) const {
  r.stage1_out = stage1_forward(r.stage1, hidden, batch);
  const Tensor expert_out = stage3_forward(r.stage3, r.stage1_out.dispatched, r.stage1_out.group_offsets);
  return stage5_forward(r.stage5, expert_out, r.stage1_out);
}

Tensor DecoderLayer::reference_backward(LayerRecord& r, const Tensor& d_out) const {
  const Stage5Grads grads = stage5_backward_input(r.stage5, d_out);
  const Tensor d_dispatched = stage3_backward_input(r.stage3, grads.d_combined);
  stage3_backward_weight(r.stage3);
  const Tensor d_hidden = stage1_backward_input(r.stage1, grads, d_dispatched);
  stage1_backward_weight(r.stage1);
  r = LayerRecord{};
  return d_hidden;
}

}  // namespace moetrain::model
