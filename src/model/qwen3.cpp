// defines: the Qwen3 / Qwen3-MoE parameter layout and decoder layer stages.
#include "model/qwen3.h"

#include <fmt/format.h>

#include "model/precision.h"
#include "ops/elementwise.h"
#include "ops/permute.h"

namespace moetrain::model {

namespace {

std::string layer_prefix(int64_t layer) { return fmt::format("layers.{}.", layer); }

void add_norm_spec(std::vector<ParamSpec>& specs, const std::string& name, const std::string& hf_name, int64_t size) {
  specs.push_back({name, {size}, {{hf_name, {size}, 0}}});
}

}  // namespace

std::vector<ParamSpec> qwen3_param_specs(const io::ModelConfig& config) {
  const int64_t h = config.hidden_size, v = config.vocab_size;
  std::vector<ParamSpec> specs;
  specs.push_back({"embed", {v, h}, {{"model.embed_tokens.weight", {v, h}, 0}}});
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string hf = fmt::format("model.layers.{}.", layer);
    add_norm_spec(specs, layer_prefix(layer) + "input_norm", hf + "input_layernorm.weight", h);
    AttentionBlock::add_param_specs(config, layer, specs);
    add_norm_spec(specs, layer_prefix(layer) + "post_norm", hf + "post_attention_layernorm.weight", h);
    if (config.layer_is_moe(layer)) {
      RouterBlock::add_param_specs(config, layer, specs);
      GatedMlp::add_expert_specs(config, layer, specs);
    } else {
      GatedMlp::add_dense_specs(config, layer, specs);
    }
  }
  add_norm_spec(specs, "final_norm", "model.norm.weight", h);
  if (!config.tie_word_embeddings) specs.push_back({"lm_head", {v, h}, {{"lm_head.weight", {v, h}, 0}}});
  return specs;
}

Qwen3DecoderLayer::Qwen3DecoderLayer(const io::ModelConfig& config, ParameterStore& store, int64_t layer)
    : layer_(layer),
      attention_(config, store, layer_prefix(layer)),
      router_(config.layer_is_moe(layer) ? std::make_unique<RouterBlock>(config, store, layer_prefix(layer)) : nullptr),
      mlp_(store, layer_prefix(layer), config.layer_is_moe(layer)) {
  norm_.eps = static_cast<float>(config.rms_norm_eps);
  if (router_) {
    moe_index_ = 0;
    for (int64_t l = 0; l < layer; ++l) moe_index_ += config.layer_is_moe(l) ? 1 : 0;
  }
  const std::string p = layer_prefix(layer);
  w_input_norm_ = store.weight(p + "input_norm"), g_input_norm_ = store.grad(p + "input_norm");
  w_post_norm_ = store.weight(p + "post_norm"), g_post_norm_ = store.grad(p + "post_norm");
}

Stage1Out Qwen3DecoderLayer::stage1_forward(Stage1Record& r, const Tensor& hidden, const MicroBatch& batch) const {
  Stream& s = default_stream(hidden.device());
  const int64_t T = hidden.size(0);
  const DType dt = hidden.dtype();
  const Device dev = hidden.device();
  r.hidden = hidden;
  r.rstd_input = Tensor::empty({T}, statistics_dtype(dt), dev);
  r.normed_input = Tensor::empty(hidden.shape(), dt, dev);
  ops::rmsnorm_forward(s, r.normed_input, r.rstd_input, hidden, w_input_norm_, norm_);
  const Tensor attn = attention_.forward(r.attention, r.normed_input, batch);

  r.residual = Tensor::empty(hidden.shape(), dt, dev);
  r.rstd_post = Tensor::empty({T}, statistics_dtype(dt), dev);
  r.normed_post = Tensor::empty(hidden.shape(), dt, dev);
  // residual = hidden + attention and its norm in one pass (the same bits as the two ops apart).
  ops::add_rmsnorm_forward(s, r.residual, r.normed_post, r.rstd_post, hidden, attn, w_post_norm_, norm_);

  Stage1Out out;
  out.residual = r.residual;
  if (!router_) {
    out.dispatched = r.normed_post;
    return out;
  }
  r.routing = router_->forward(r.router, r.normed_post);
  if (batch.router_loss != nullptr && batch.router_loss->active()) {
    // On the router's device: host math on the CPU; on CUDA device kernels that leave the values in
    // r.aux.on_device (no host synchronisation; the readers call resolve()).
    const Tensor& cu_seqlens = dev.is_cpu() ? batch.cu_seqlens_host : batch.cu_seqlens;
    r.aux = router_aux_losses(*batch.router_loss, moe_index_, r.routing.logits, r.routing.probs, r.routing.topk_index,
                              cu_seqlens, r.d_probs, r.d_logits);
  }
  out.routing = r.routing;
  out.group_offsets = r.routing.plan.expert_offsets;
  out.dispatched = Tensor::empty({T * r.routing.plan.top_k, hidden.size(1)}, dt, dev);
  ops::permute_forward(s, out.dispatched, r.normed_post, r.routing.plan);
  return out;
}

Tensor Qwen3DecoderLayer::stage3_forward(Stage3Record& r, const Tensor& dispatched, const Tensor& group_offsets) const {
  return mlp_.forward(r.mlp, dispatched, group_offsets);
}

Tensor Qwen3DecoderLayer::stage5_forward(Stage5Record& r, const Tensor& combined, const Stage1Out& stage1) const {
  Stream& s = default_stream(combined.device());
  Tensor out = Tensor::empty(stage1.residual.shape(), stage1.residual.dtype(), stage1.residual.device());
  if (!router_) {
    ops::add_forward(s, out, stage1.residual, combined);
    return out;
  }
  r.combined = combined;
  r.routing = stage1.routing;
  ops::unpermute_forward(s, out, combined, stage1.routing.topk_weight, stage1.routing.plan);
  ops::accumulate(s, out, stage1.residual);
  return out;
}

Stage5Grads Qwen3DecoderLayer::stage5_backward_input(Stage5Record& r, const Tensor& d_out) const {
  Stage5Grads g;
  g.d_residual = d_out;
  if (!router_) {
    g.d_combined = d_out;
    return g;
  }
  g.d_combined = Tensor::empty(r.combined.shape(), d_out.dtype(), d_out.device());
  g.d_topk_weight = Tensor::empty(r.routing.topk_weight.shape(), r.routing.topk_weight.dtype(), d_out.device());
  ops::unpermute_backward(default_stream(d_out.device()), g.d_combined, g.d_topk_weight, d_out, r.combined,
                          r.routing.topk_weight, r.routing.plan);
  r = Stage5Record{};
  return g;
}

Tensor Qwen3DecoderLayer::stage3_backward_input(Stage3Record& r, const Tensor& d_combined) const {
  return mlp_.backward_input(r.mlp, d_combined);
}

void Qwen3DecoderLayer::stage3_backward_weight(Stage3Record& r) const { mlp_.backward_weight(r.mlp); }

Tensor Qwen3DecoderLayer::stage1_backward_input(Stage1Record& r, const Stage5Grads& grads,
                                                const Tensor& d_dispatched) const {
  Stream& s = default_stream(d_dispatched.device());
  const DType dt = d_dispatched.dtype();
  const Device dev = d_dispatched.device();
  // Gradient reaching the post-attention norm's output.
  if (router_) {
    r.d_normed_post = Tensor::empty(r.normed_post.shape(), dt, dev);
    ops::permute_backward(s, r.d_normed_post, d_dispatched, r.routing.plan);
    const Tensor d_router_in = router_->backward_input(r.router, r.routing, grads.d_topk_weight, r.d_probs, r.d_logits);
    ops::accumulate(s, r.d_normed_post, d_router_in);
  } else {
    r.d_normed_post = d_dispatched;
  }
  Tensor d_residual = Tensor::empty(r.residual.shape(), dt, dev);
  ops::rmsnorm_backward_input(s, d_residual, r.d_normed_post, r.residual, w_post_norm_, r.rstd_post, norm_);
  ops::accumulate(s, d_residual, grads.d_residual);

  r.d_normed_input = attention_.backward_input(r.attention, d_residual);
  Tensor d_hidden = Tensor::empty(r.hidden.shape(), dt, dev);
  ops::rmsnorm_backward_input(s, d_hidden, r.d_normed_input, r.hidden, w_input_norm_, r.rstd_input, norm_);
  ops::accumulate(s, d_hidden, d_residual);
  return d_hidden;
}

void Qwen3DecoderLayer::stage1_backward_weight(Stage1Record& r) const {
  Stream& s = default_stream(r.hidden.device());
  attention_.backward_weight(r.attention);
  if (router_) router_->backward_weight(r.router);
  ops::rmsnorm_backward_weight(s, g_post_norm_, r.d_normed_post, r.residual, r.rstd_post);
  ops::rmsnorm_backward_weight(s, g_input_norm_, r.d_normed_input, r.hidden, r.rstd_input);
  r = Stage1Record{};
}

}  // namespace moetrain::model
