// defines: the Qwen3 attention block's parameters, forward and split backward.
#include "model/attention_block.h"

#include <cmath>

#include "core/device.h"
#include "model/precision.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"

namespace moetrain::model {

void AttentionBlock::add_param_specs(const io::ModelConfig& config, int64_t layer, std::vector<ParamSpec>& specs) {
  const std::string hf = fmt::format("model.layers.{}.self_attn.", layer);
  const std::string in = fmt::format("layers.{}.attn.", layer);
  const int64_t h = config.hidden_size, hd = config.head_dim;
  const int64_t q_rows = config.num_attention_heads * hd, kv_rows = config.num_key_value_heads * hd;
  auto single = [&](const std::string& name, const std::string& hf_name, Shape shape) {
    specs.push_back({in + name, shape, {{hf + hf_name, shape, 0}}});
  };
  single("q_proj", "q_proj.weight", {q_rows, h});
  single("k_proj", "k_proj.weight", {kv_rows, h});
  single("v_proj", "v_proj.weight", {kv_rows, h});
  single("o_proj", "o_proj.weight", {h, q_rows});
  single("q_norm", "q_norm.weight", {hd});
  single("k_norm", "k_norm.weight", {hd});
}

AttentionBlock::AttentionBlock(const io::ModelConfig& config, ParameterStore& store, const std::string& prefix)
    : config_(config),
      heads_(config.num_attention_heads),
      kv_heads_(config.num_key_value_heads),
      head_dim_(config.head_dim) {
  MT_CHECK(!config.attention_bias, "attention block: attention_bias = true is not supported for {}", config.model_type);
  qk_norm_.eps = static_cast<float>(config.rms_norm_eps);
  const int rotary_dim = static_cast<int>(std::llround(double(head_dim_) * config.partial_rotary_factor));
  rope_ = ops::rope_default_params(rotary_dim - rotary_dim % 2, config.rope_theta);
  attention_.softmax_scale = static_cast<float>(1.0 / std::sqrt(double(head_dim_)));
  const std::string p = prefix + "attn.";
  w_q_ = store.weight(p + "q_proj"), g_q_ = store.grad(p + "q_proj");
  w_k_ = store.weight(p + "k_proj"), g_k_ = store.grad(p + "k_proj");
  w_v_ = store.weight(p + "v_proj"), g_v_ = store.grad(p + "v_proj");
  w_o_ = store.weight(p + "o_proj"), g_o_ = store.grad(p + "o_proj");
  w_q_norm_ = store.weight(p + "q_norm"), g_q_norm_ = store.grad(p + "q_norm");
  w_k_norm_ = store.weight(p + "k_norm"), g_k_norm_ = store.grad(p + "k_norm");
}

// The longest document lets the CUDA backend plan cuDNN's attention for the batch (bf16); the CPU
// reference ignores it.
ops::AttentionParams AttentionBlock::attention_for(const MicroBatch& batch) const {
  ops::AttentionParams params = attention_;
  params.max_seqlen = batch.max_document_length();
  return params;
}

Tensor AttentionBlock::forward(AttentionRecord& r, const Tensor& x, const MicroBatch& batch) const {
  Stream& s = default_stream(x.device());
  const int64_t T = x.size(0);
  const DType dt = x.dtype();
  const Device dev = x.device();
  r.x = x;
  r.batch = &batch;
  r.q = Tensor::empty({T, heads_, head_dim_}, dt, dev);
  r.k = Tensor::empty({T, kv_heads_, head_dim_}, dt, dev);
  r.v = Tensor::empty({T, kv_heads_, head_dim_}, dt, dev);
  ops::linear_forward(s, r.q.view({T, -1}), x, w_q_);
  ops::linear_forward(s, r.k.view({T, -1}), x, w_k_);
  ops::linear_forward(s, r.v.view({T, -1}), x, w_v_);

  r.rstd_q = Tensor::empty({T * heads_}, statistics_dtype(dt), dev);
  r.rstd_k = Tensor::empty({T * kv_heads_}, statistics_dtype(dt), dev);
  r.q_rot = Tensor::empty(r.q.shape(), dt, dev);
  r.k_rot = Tensor::empty(r.k.shape(), dt, dev);
  ops::rmsnorm_forward(s, r.q_rot, r.rstd_q, r.q, w_q_norm_, qk_norm_);
  ops::rmsnorm_forward(s, r.k_rot, r.rstd_k, r.k, w_k_norm_, qk_norm_);
  ops::rope_forward(s, r.q_rot, r.q_rot, batch.position_ids, rope_);
  ops::rope_forward(s, r.k_rot, r.k_rot, batch.position_ids, rope_);

  r.attn = Tensor::empty({T, heads_, head_dim_}, dt, dev);
  r.lse = Tensor::empty({T, heads_}, statistics_dtype(dt), dev);
  ops::attention_forward(s, r.attn, r.lse, r.q_rot, r.k_rot, r.v, batch.cu_seqlens, attention_for(batch));

  Tensor out = Tensor::empty({T, config_.hidden_size}, dt, dev);
  ops::linear_forward(s, out, r.attn.view({T, -1}), w_o_);
  return out;
}

Tensor AttentionBlock::backward_input(AttentionRecord& r, const Tensor& d_out) const {
  Stream& s = default_stream(d_out.device());
  const int64_t T = d_out.size(0);
  const DType dt = d_out.dtype();
  const Device dev = d_out.device();
  r.d_out = d_out;
  Tensor d_attn = Tensor::empty({T, heads_, head_dim_}, dt, dev);
  ops::linear_backward_input(s, d_attn.view({T, -1}), d_out, w_o_);

  Tensor d_q_rot = Tensor::empty(r.q.shape(), dt, dev);
  Tensor d_k_rot = Tensor::empty(r.k.shape(), dt, dev);
  r.d_v = Tensor::empty(r.v.shape(), dt, dev);
  ops::attention_backward(s, d_q_rot, d_k_rot, r.d_v, d_attn, r.q_rot, r.k_rot, r.v, r.attn, r.lse, r.batch->cu_seqlens,
                          attention_for(*r.batch));
  r.d_q_normed = d_q_rot;  // rope's backward runs in place: d_q_rot becomes d(q after norm)
  r.d_k_normed = d_k_rot;
  ops::rope_backward(s, r.d_q_normed, d_q_rot, r.batch->position_ids, rope_);
  ops::rope_backward(s, r.d_k_normed, d_k_rot, r.batch->position_ids, rope_);
  r.d_q = Tensor::empty(r.q.shape(), dt, dev);
  r.d_k = Tensor::empty(r.k.shape(), dt, dev);
  ops::rmsnorm_backward_input(s, r.d_q, r.d_q_normed, r.q, w_q_norm_, r.rstd_q, qk_norm_);
  ops::rmsnorm_backward_input(s, r.d_k, r.d_k_normed, r.k, w_k_norm_, r.rstd_k, qk_norm_);

  Tensor dx = Tensor::empty(r.x.shape(), dt, dev);
  Tensor partial = Tensor::empty(r.x.shape(), dt, dev);
  ops::linear_backward_input(s, dx, r.d_q.view({T, -1}), w_q_);
  ops::linear_backward_input(s, partial, r.d_k.view({T, -1}), w_k_);
  ops::accumulate(s, dx, partial);
  ops::linear_backward_input(s, partial, r.d_v.view({T, -1}), w_v_);
  ops::accumulate(s, dx, partial);
  return dx;
}

void AttentionBlock::backward_weight(AttentionRecord& r) const {
  Stream& s = default_stream(r.x.device());
  const int64_t T = r.x.size(0);
  ops::linear_backward_weight(s, g_o_, r.d_out, r.attn.view({T, -1}));
  ops::linear_backward_weight(s, g_q_, r.d_q.view({T, -1}), r.x);
  ops::linear_backward_weight(s, g_k_, r.d_k.view({T, -1}), r.x);
  ops::linear_backward_weight(s, g_v_, r.d_v.view({T, -1}), r.x);
  ops::rmsnorm_backward_weight(s, g_q_norm_, r.d_q_normed, r.q, r.rstd_q);
  ops::rmsnorm_backward_weight(s, g_k_norm_, r.d_k_normed, r.k, r.rstd_k);
  r = AttentionRecord{};  // the record's work is done: free its activations now
}

}  // namespace moetrain::model
