// defines: the pre-norm decoder layer's parameters and its five stages, forward and split backward.
#include "model/blocks/pre_norm_layer.h"

#include "core/error.h"
#include "model/precision.h"
#include "ops/elementwise.h"
#include "ops/permute.h"

namespace moetrain::model {

namespace {

struct PreNormRecord final : LayerRecord {
  // Stage 1.
  Tensor hidden, rstd_input, normed_input;
  std::unique_ptr<MixerRecord> mixer;
  Tensor residual, rstd_post, normed_post;
  RouterRecord router;
  RoutingMetadata routing;
  Tensor d_probs, d_logits;  // the auxiliary router losses' gradients, injected by stage 1's backward
  // Stage 3.
  MlpRecord mlp;
  // Stage 5.
  Tensor combined;  // stage 3's output rows as they came back
  SharedExpertRecord shared;
  // Kept from stage 5's backward for stage 1's: the gradient of the residual and of the selected weights, and the
  // shared expert's input gradient.
  Tensor d_residual, d_topk_weight, d_shared_in;
};

PreNormRecord& as_pre_norm(LayerRecord& record) {
  auto* r = dynamic_cast<PreNormRecord*>(&record);
  MT_CHECK(r != nullptr, "decoder layer: given a record of another kind of layer");
  return *r;
}

// A zero-centred norm (scale 1 + w) starts at w = 0, a plain one at w = 1: both the identity scale.
ParamSpec norm_spec(const std::string& name, int64_t size, int64_t layer, const ops::RmsNormParams& norm) {
  ParamSpec spec;
  spec.name = name;
  spec.shape = {size};
  spec.role = ParamRole::Norm;
  spec.layer = layer;
  spec.init = norm.zero_centered ? ParamInit::Zeros : ParamInit::Ones;
  return spec;
}

void append(std::vector<ParamSpec>& to, std::vector<ParamSpec> from) {
  for (ParamSpec& spec : from) to.push_back(std::move(spec));
}

const GatedMlpOptions& ffn_options(const PreNormLayerOptions& o) {
  MT_CHECK(o.dense_mlp.has_value() != o.moe.has_value(),
           "decoder layer {}: expected exactly one of a dense MLP and an expert bank but found {}", o.layer,
           o.moe.has_value() ? "both" : "neither");
  return o.moe ? o.moe->experts : *o.dense_mlp;
}

}  // namespace

std::vector<ParamSpec> PreNormLayer::param_specs(const PreNormLayerOptions& o, std::vector<ParamSpec> mixer_specs,
                                                 const std::string& prefix) {
  std::vector<ParamSpec> specs;
  specs.push_back(norm_spec(prefix + "input_norm", o.hidden_size, o.layer, o.norm));
  append(specs, std::move(mixer_specs));
  specs.push_back(norm_spec(prefix + "post_norm", o.hidden_size, o.layer, o.norm));
  if (o.moe) {
    append(specs, Router::param_specs(o.moe->router, prefix, o.layer));
    append(specs, GatedMlp::param_specs(o.moe->experts, prefix + "experts.", o.layer));
    if (o.moe->shared_expert)
      append(specs, SharedExpert::param_specs(*o.moe->shared_expert, prefix + "shared_expert.", o.layer));
  } else {
    append(specs, GatedMlp::param_specs(ffn_options(o), prefix + "mlp.", o.layer));
  }
  return specs;
}

PreNormLayer::PreNormLayer(const PreNormLayerOptions& options, std::unique_ptr<TokenMixer> mixer, ParameterStore& store,
                           const std::string& prefix)
    : options_(options),
      compute_dtype_(store.compute_dtype()),
      mixer_(std::move(mixer)),
      router_(options.moe ? std::make_unique<Router>(options.moe->router, store, prefix) : nullptr),
      shared_expert_(options.moe && options.moe->shared_expert
                         ? std::make_unique<SharedExpert>(*options.moe->shared_expert, store, prefix + "shared_expert.")
                         : nullptr),
      mlp_(ffn_options(options), store, prefix + (options.moe ? "experts." : "mlp.")) {
  MT_CHECK(mixer_ != nullptr, "decoder layer {}: no token mixer", options.layer);
  MT_CHECK(!options.moe || options.moe_index >= 0, "decoder layer {}: an MoE layer needs its MoE index", options.layer);
  w_input_norm_ = store.weight(prefix + "input_norm"), g_input_norm_ = store.grad(prefix + "input_norm");
  w_post_norm_ = store.weight(prefix + "post_norm"), g_post_norm_ = store.grad(prefix + "post_norm");
}

void PreNormLayer::set_recompute_activation(bool on) {
  mlp_.set_recompute_activation(on);
  if (shared_expert_) shared_expert_->set_recompute_activation(on);
}

std::unique_ptr<LayerRecord> PreNormLayer::new_record() const {
  auto record = std::make_unique<PreNormRecord>();
  record->mixer = mixer_->new_record();
  return record;
}

Dispatch PreNormLayer::stage1_forward(LayerRecord& record, const Tensor& hidden, const MicroBatch& batch) const {
  PreNormRecord& r = as_pre_norm(record);
  Stream& s = default_stream(hidden.device());
  const int64_t T = hidden.size(0);
  const DType dt = compute_dtype_;  // the norms' outputs and everything after them; the stream keeps hidden's dtype
  const Device dev = hidden.device();
  r.hidden = hidden;
  r.rstd_input = Tensor::empty({T}, statistics_dtype(dt), dev);
  r.normed_input = Tensor::empty(hidden.shape(), dt, dev);
  ops::rmsnorm_forward(s, r.normed_input, r.rstd_input, hidden, w_input_norm_, options_.norm);
  const Tensor mixed = mixer_->forward(*r.mixer, r.normed_input, batch);

  r.residual = Tensor::empty(hidden.shape(), hidden.dtype(), dev);
  r.rstd_post = Tensor::empty({T}, statistics_dtype(dt), dev);
  r.normed_post = Tensor::empty(hidden.shape(), dt, dev);
  // residual = hidden + mixed and its norm in one pass (the same bits as the two ops apart).
  ops::add_rmsnorm_forward(s, r.residual, r.normed_post, r.rstd_post, hidden, mixed, w_post_norm_, options_.norm);

  Dispatch out;
  if (!router_) {
    out.rows = r.normed_post;
    return out;
  }
  Tensor pinned;
  if (batch.pinned_routing != nullptr) {
    MT_CHECK(options_.moe_index >= 0 && static_cast<size_t>(options_.moe_index) < batch.pinned_routing->size(),
             "layer {}: the micro-batch pins the routing of {} MoE layers but this is MoE layer {}", options_.layer,
             batch.pinned_routing->size(), options_.moe_index);
    pinned = (*batch.pinned_routing)[static_cast<size_t>(options_.moe_index)];
  }
  r.routing = router_->forward(r.router, r.normed_post, pinned);
  r.router_logits = r.routing.logits;
  if (batch.router_loss != nullptr && batch.router_loss->active()) {
    // On the router's device: host math on the CPU; on CUDA device kernels that leave the values in
    // r.aux.on_device (no host synchronisation; the readers call resolve()).
    const Tensor& cu_seqlens = dev.is_cpu() ? batch.cu_seqlens_host : batch.cu_seqlens;
    r.aux = router_aux_losses(*batch.router_loss, options_.moe_index, r.routing.logits, r.routing.probs,
                              r.routing.topk_index, cu_seqlens, r.d_probs, r.d_logits);
  }
  out.group_offsets = r.routing.plan.expert_offsets;
  out.row_choice = r.routing.plan.row_choice;
  out.topk_index = r.routing.topk_index;
  out.rows = Tensor::empty({T * r.routing.plan.top_k, hidden.size(1)}, dt, dev);
  ops::permute_forward(s, out.rows, r.normed_post, r.routing.plan);
  return out;
}

Tensor PreNormLayer::stage3_forward(LayerRecord& record, const Tensor& rows, const Tensor& group_offsets) const {
  return mlp_.forward(as_pre_norm(record).mlp, rows, group_offsets);
}

Tensor PreNormLayer::stage5_forward(LayerRecord& record, const Tensor& combined) const {
  PreNormRecord& r = as_pre_norm(record);
  Stream& s = default_stream(combined.device());
  Tensor out = Tensor::empty(r.residual.shape(), r.residual.dtype(), r.residual.device());
  if (!router_) {
    ops::add_forward(s, out, r.residual, combined);
    return out;
  }
  r.combined = combined;
  ops::unpermute_forward_add(s, out, combined, r.routing.topk_weight, r.routing.plan, r.residual);
  if (shared_expert_) ops::accumulate(s, out, shared_expert_->forward(r.shared, r.normed_post));
  return out;
}

Tensor PreNormLayer::stage5_backward_input(LayerRecord& record, const Tensor& d_out) const {
  PreNormRecord& r = as_pre_norm(record);
  r.d_residual = d_out;
  // The f32 stream's gradient enters the GEMMs' backward rounded to the compute dtype, as autocast casts it there.
  if (!router_) return ops::in_dtype(default_stream(d_out.device()), d_out, compute_dtype_);
  // The weighted sum's gradient reads the stream's gradient as it is (f32 under an f32 stream) and writes the rows'.
  Tensor d_combined = Tensor::empty(r.combined.shape(), r.combined.dtype(), d_out.device());
  r.d_topk_weight = Tensor::empty(r.routing.topk_weight.shape(), r.routing.topk_weight.dtype(), d_out.device());
  ops::unpermute_backward(default_stream(d_out.device()), d_combined, r.d_topk_weight, d_out, r.combined,
                          r.routing.topk_weight, r.routing.plan);
  if (shared_expert_)
    r.d_shared_in =
        shared_expert_->backward_input(r.shared, ops::in_dtype(default_stream(d_out.device()), d_out, compute_dtype_));
  r.combined = Tensor();
  return d_combined;
}

Tensor PreNormLayer::stage3_backward_input(LayerRecord& record, const Tensor& d_combined) const {
  return mlp_.backward_input(as_pre_norm(record).mlp, d_combined);
}

void PreNormLayer::stage3_backward_weight(LayerRecord& record) const { mlp_.backward_weight(as_pre_norm(record).mlp); }

std::unique_ptr<LayerRecord> PreNormLayer::take_stage3_weight_work(LayerRecord& record, bool own_rows) const {
  PreNormRecord& r = as_pre_norm(record);
  auto held = std::make_unique<PreNormRecord>();
  held->mlp = std::move(r.mlp);
  r.mlp = MlpRecord{};
  GatedMlp::keep_for_weight_work(held->mlp);
  if (own_rows && router_ && r.d_residual.defined()) {
    // Stage 3's rows are stage 1's permutation of normed_post, and their gradient is stage 5's weighted copies of
    // the layer output's gradient: hold those [T, H] tensors instead of the [T*K, H] rows (K times less memory).
    held->mlp.x_source = ops::PermutedRows{r.normed_post, Tensor(), r.routing.plan};
    held->mlp.d_y_source = ops::PermutedRows{r.d_residual, r.routing.topk_weight, r.routing.plan};
    held->mlp.x = held->mlp.d_y = Tensor();
  }
  return held;
}

void PreNormLayer::stage3_backward_weight_together(const std::vector<LayerRecord*>& records) const {
  std::vector<MlpRecord*> mlps;
  for (LayerRecord* record : records) mlps.push_back(&as_pre_norm(*record).mlp);
  mlp_.backward_weight_together(mlps);
}

Tensor PreNormLayer::stage1_backward_input(LayerRecord& record, const Tensor& d_dispatched) const {
  PreNormRecord& r = as_pre_norm(record);
  Stream& s = default_stream(d_dispatched.device());
  const DType stream_dt = r.hidden.dtype();
  const Device dev = d_dispatched.device();
  // Gradient reaching the post-mixer norm's output. Its three parts (experts, router, shared expert) are summed in
  // the stream's dtype: under an f32 stream the sum is f32, as autocast sums the gradients of one f32 tensor.
  Tensor d_normed_post = d_dispatched;
  if (router_) {
    d_normed_post = Tensor::empty(r.normed_post.shape(), stream_dt, dev);
    const Tensor d_router_in = router_->backward_input(r.router, r.routing, r.d_topk_weight, r.d_probs, r.d_logits);
    ops::permute_backward_add(s, d_normed_post, d_dispatched, r.routing.plan, d_router_in);
    if (shared_expert_) ops::accumulate(s, d_normed_post, r.d_shared_in);
  }
  // Each norm's input gradient takes the residual path's gradient, and its weight gradient its terms, in one pass
  // over the rows where the backend can (the norm's weight gradient is made here, not in backward_weight, so the
  // norm's output gradient is not held until then).
  Tensor d_residual = Tensor::empty(r.residual.shape(), stream_dt, dev);
  ops::rmsnorm_backward(s, d_residual, g_post_norm_, d_normed_post, r.residual, w_post_norm_, r.rstd_post,
                        options_.norm, r.d_residual);
  d_normed_post = Tensor();  // not held through the mixer's backward

  const Tensor d_normed_input = mixer_->backward_input(*r.mixer, ops::in_dtype(s, d_residual, compute_dtype_));
  Tensor d_hidden = Tensor::empty(r.hidden.shape(), stream_dt, dev);
  ops::rmsnorm_backward(s, d_hidden, g_input_norm_, d_normed_input, r.hidden, w_input_norm_, r.rstd_input,
                        options_.norm, d_residual);
  r.d_residual = r.d_topk_weight = r.d_shared_in = Tensor();
  return d_hidden;
}

void PreNormLayer::stage1_backward_weight(LayerRecord& record) const {
  PreNormRecord& r = as_pre_norm(record);
  mixer_->backward_weight(*r.mixer);
  if (router_) router_->backward_weight(r.router);
  if (shared_expert_) shared_expert_->backward_weight(r.shared);
  // Free the stage-1 activations now (the record itself lives until the executor drops it).
  std::unique_ptr<MixerRecord> mixer = std::move(r.mixer);
  r = PreNormRecord{};
  r.mixer = std::move(mixer);
}

}  // namespace moetrain::model
