// defines: GqaAttention's parameters, forward and split backward.
#include "model/blocks/attention.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "model/blocks/cached_attention.h"
#include "model/precision.h"
#include "ops/activation.h"
#include "ops/bias.h"
#include "ops/columns.h"
#include "ops/gemm.h"
#include "ops/norm_rope.h"

namespace moetrain::model {

namespace {

struct AttentionRecord final : MixerRecord {
  Tensor x;               // [T, H] block input (already normed)
  Tensor q, k, v;         // projections before the q/k norm: [T, nh, hd], [T, nkv, hd], [T, nkv, hd]
  Tensor q_gate;          // output gate: q_proj's output [T, nh, 2 hd] (query then gate per head)
  Tensor gate, gated;     // output gate: the gate [T, nh, hd] and attn * sigmoid(gate) [T, nh, hd]
  Tensor rstd_q, rstd_k;  // [T * nh], [T * nkv] (qk_norm)
  Tensor q_rot, k_rot;    // after norm and rope: what attention saw
  Tensor attn, lse;       // attention output [T, nh, hd] and its log-sum-exp [T, nh] (with the sinks when on)
  const MicroBatch* batch = nullptr;
  // Kept by backward_input for backward_weight. d_q_normed / d_k_normed: q/k norm without rope only (with rope,
  // backward_input adds the norms' weight gradients itself).
  Tensor d_out, d_attn, d_q_normed, d_k_normed, d_q, d_k, d_v;
  Tensor d_q_proj;  // the gradient of q_proj's output: d_q, or with the output gate [T, nh, 2 hd] of d_q and d_gate
};

AttentionRecord& as_attention(MixerRecord& record) {
  auto* r = dynamic_cast<AttentionRecord*>(&record);
  MT_CHECK(r != nullptr, "attention block: given a record of another token mixer");
  return *r;
}

void refuse_unsupported(const AttentionOptions& o) {
  MT_CHECK(o.sliding_window >= 0 && o.sliding_window <= std::numeric_limits<int>::max(),
           "attention block: sliding_window must be in [0, 2^31) (0: the whole document) but is {}", o.sliding_window);
}

// The gradient of a projection's bias, if it has one.
void bias_grad(Stream& s, const Tensor& g_bias, const Tensor& dy) {
  if (g_bias.defined()) ops::bias_backward(s, g_bias, dy);
}

}  // namespace

std::vector<ParamSpec> GqaAttention::param_specs(const AttentionOptions& o, const std::string& prefix, int64_t layer) {
  const int64_t h = o.hidden_size, hd = o.head_dim;
  const int64_t q_rows = o.num_heads * hd * (o.output_gate ? 2 : 1), kv_rows = o.num_kv_heads * hd;
  std::vector<ParamSpec> specs;
  const auto add = [&](const char* name, Shape shape, ParamRole role) {
    ParamSpec spec;
    spec.name = prefix + name;
    spec.shape = std::move(shape);
    spec.role = role;
    spec.layer = layer;
    spec.init = spec.is_matrix() ? ParamInit::Normal : ParamInit::Ones;
    specs.push_back(std::move(spec));
  };
  const auto add_vector = [&](const char* name, int64_t size, ParamInit init) {
    add(name, {size}, ParamRole::Dense);
    specs.back().init = init;
  };
  add("q_proj", {q_rows, h}, ParamRole::Dense);
  add("k_proj", {kv_rows, h}, ParamRole::Dense);
  add("v_proj", {kv_rows, h}, ParamRole::Dense);
  add("o_proj", {h, o.num_heads * hd}, ParamRole::Dense);
  if (o.qk_norm) {
    add("q_norm", {hd}, ParamRole::Norm);
    add("k_norm", {hd}, ParamRole::Norm);
    if (o.qk_norm_zero_centered) specs[specs.size() - 2].init = specs.back().init = ParamInit::Zeros;  // 1 + w = 1
  }
  if (o.qkv_bias) {
    add_vector("q_bias", q_rows, ParamInit::Zeros);
    add_vector("k_bias", kv_rows, ParamInit::Zeros);
    add_vector("v_bias", kv_rows, ParamInit::Zeros);
  }
  if (o.output_bias) add_vector("o_bias", h, ParamInit::Zeros);
  if (o.sinks) add_vector("sinks", o.num_heads, ParamInit::Normal);  // N(0, std), as transformers' GPT-OSS
  return specs;
}

GqaAttention::GqaAttention(const AttentionOptions& options, ParameterStore& store, const std::string& prefix)
    : options_(options) {
  refuse_unsupported(options);
  MT_CHECK(
      options.num_heads > 0 && options.num_kv_heads > 0 && options.num_heads % options.num_kv_heads == 0 &&
          options.head_dim > 0,
      "attention block: {} heads over {} kv heads of dim {}: expected positive sizes, heads a multiple of kv heads",
      options.num_heads, options.num_kv_heads, options.head_dim);
  MT_CHECK(options.rope.rotary_dim % 2 == 0 && options.rope.rotary_dim <= options.head_dim,
           "attention block: rotary dim {} must be even and at most the head dim {}", options.rope.rotary_dim,
           options.head_dim);
  qk_norm_.eps = options.norm_eps;
  qk_norm_.zero_centered = options.qk_norm_zero_centered;
  rope_ = options.rope;
  attention_.softmax_scale = static_cast<float>(
      options.softmax_scale > 0.0 ? options.softmax_scale : 1.0 / std::sqrt(double(options.head_dim)));
  attention_.sliding_window = static_cast<int>(options.sliding_window);
  w_q_ = store.weight(prefix + "q_proj"), g_q_ = store.grad(prefix + "q_proj");
  w_k_ = store.weight(prefix + "k_proj"), g_k_ = store.grad(prefix + "k_proj");
  w_v_ = store.weight(prefix + "v_proj"), g_v_ = store.grad(prefix + "v_proj");
  w_o_ = store.weight(prefix + "o_proj"), g_o_ = store.grad(prefix + "o_proj");
  q_writer_ = GradientWriter(store, prefix + "q_proj"), k_writer_ = GradientWriter(store, prefix + "k_proj");
  v_writer_ = GradientWriter(store, prefix + "v_proj"), o_writer_ = GradientWriter(store, prefix + "o_proj");
  if (options.qk_norm) {
    w_q_norm_ = store.weight(prefix + "q_norm"), g_q_norm_ = store.grad(prefix + "q_norm");
    w_k_norm_ = store.weight(prefix + "k_norm"), g_k_norm_ = store.grad(prefix + "k_norm");
  }
  if (options.qkv_bias) {
    w_q_bias_ = store.weight(prefix + "q_bias"), g_q_bias_ = store.grad(prefix + "q_bias");
    w_k_bias_ = store.weight(prefix + "k_bias"), g_k_bias_ = store.grad(prefix + "k_bias");
    w_v_bias_ = store.weight(prefix + "v_bias"), g_v_bias_ = store.grad(prefix + "v_bias");
  }
  if (options.output_bias) w_o_bias_ = store.weight(prefix + "o_bias"), g_o_bias_ = store.grad(prefix + "o_bias");
  if (options.sinks) w_sinks_ = store.weight(prefix + "sinks"), g_sinks_ = store.grad(prefix + "sinks");
}

std::unique_ptr<MixerRecord> GqaAttention::new_record() const { return std::make_unique<AttentionRecord>(); }

// The longest document lets the CUDA backend plan cuDNN's attention for the batch (bf16); the CPU
// reference ignores it.
ops::AttentionParams GqaAttention::attention_for(const MicroBatch& batch) const {
  ops::AttentionParams params = attention_;
  params.max_seqlen = batch.max_document_length();
  return params;
}

Tensor GqaAttention::forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const {
  AttentionRecord& r = as_attention(record);
  Stream& s = default_stream(x.device());
  const int64_t T = x.size(0), nh = options_.num_heads, nkv = options_.num_kv_heads, hd = options_.head_dim;
  const DType dt = x.dtype();
  const Device dev = x.device();
  r.x = x;
  r.batch = &batch;
  r.q = Tensor::empty({T, nh, hd}, dt, dev);
  r.k = Tensor::empty({T, nkv, hd}, dt, dev);
  r.v = Tensor::empty({T, nkv, hd}, dt, dev);
  if (options_.output_gate) {
    // q_proj's rows per head: the query, then the gate (transformers' chunk of the [.., nh, 2 hd] view).
    r.q_gate = Tensor::empty({T, nh, 2 * hd}, dt, dev);
    r.gate = Tensor::empty({T, nh, hd}, dt, dev);
    ops::biased_linear_forward(s, r.q_gate.view({T, -1}), x, w_q_, w_q_bias_);
    ops::copy_columns(s, r.q.view({T * nh, hd}), 0, r.q_gate.view({T * nh, 2 * hd}), 0, hd);
    ops::copy_columns(s, r.gate.view({T * nh, hd}), 0, r.q_gate.view({T * nh, 2 * hd}), hd, hd);
  } else {
    ops::biased_linear_forward(s, r.q.view({T, -1}), x, w_q_, w_q_bias_);
  }
  ops::biased_linear_forward(s, r.k.view({T, -1}), x, w_k_, w_k_bias_);
  ops::biased_linear_forward(s, r.v.view({T, -1}), x, w_v_, w_v_bias_);

  const bool rotary = rope_.rotary_dim > 0;
  if (options_.qk_norm) {
    r.rstd_q = Tensor::empty({T * nh}, statistics_dtype(dt), dev);
    r.rstd_k = Tensor::empty({T * nkv}, statistics_dtype(dt), dev);
    r.q_rot = Tensor::empty(r.q.shape(), dt, dev);
    r.k_rot = Tensor::empty(r.k.shape(), dt, dev);
    if (rotary) {
      ops::rmsnorm_rope_forward(s, r.q_rot, r.rstd_q, r.q, w_q_norm_, qk_norm_, batch.position_ids, rope_);
      ops::rmsnorm_rope_forward(s, r.k_rot, r.rstd_k, r.k, w_k_norm_, qk_norm_, batch.position_ids, rope_);
    } else {
      ops::rmsnorm_forward(s, r.q_rot, r.rstd_q, r.q, w_q_norm_, qk_norm_);
      ops::rmsnorm_forward(s, r.k_rot, r.rstd_k, r.k, w_k_norm_, qk_norm_);
    }
  } else {
    r.q_rot = r.q.clone();
    r.k_rot = r.k.clone();
    if (rotary) {
      ops::rope_forward(s, r.q_rot, r.q_rot, batch.position_ids, rope_);
      ops::rope_forward(s, r.k_rot, r.k_rot, batch.position_ids, rope_);
    }
  }

  r.attn = Tensor::empty({T, nh, hd}, dt, dev);
  r.lse = Tensor::empty({T, nh}, statistics_dtype(dt), dev);
  attend(s, r.attn, r.lse, r.q_rot, r.k_rot, r.v, batch, attention_for(batch), this);
  // The sinks rescale each (token, head) from its log-sum-exp; the backward below then runs the plain attention
  // backward on the rescaled output and log-sum-exp, which is the exact gradient of the softmax with the sink.
  if (options_.sinks) ops::attention_sinks_forward(s, r.attn, r.lse, w_sinks_);

  Tensor out = Tensor::empty({T, options_.hidden_size}, dt, dev);
  if (options_.output_gate) {
    r.gated = Tensor::empty({T, nh, hd}, dt, dev);
    ops::sigmoid_gate_forward(s, r.gated.view({T, -1}), r.attn.view({T, -1}), r.gate.view({T, -1}));
  }
  ops::biased_linear_forward(s, out, (options_.output_gate ? r.gated : r.attn).view({T, -1}), w_o_, w_o_bias_);
  return out;
}

Tensor GqaAttention::backward_input(MixerRecord& record, const Tensor& d_out) const {
  AttentionRecord& r = as_attention(record);
  Stream& s = default_stream(d_out.device());
  const int64_t T = d_out.size(0);
  const DType dt = d_out.dtype();
  const Device dev = d_out.device();
  r.d_out = d_out;
  const int64_t nh = options_.num_heads, hd = options_.head_dim;
  Tensor d_attn = Tensor::empty({T, nh, hd}, dt, dev);
  Tensor d_gate;
  if (options_.output_gate) {
    Tensor d_gated = Tensor::empty({T, nh, hd}, dt, dev);
    d_gate = Tensor::empty({T, nh, hd}, dt, dev);
    ops::linear_backward_input(s, d_gated.view({T, -1}), d_out, w_o_);
    ops::sigmoid_gate_backward(s, d_attn.view({T, -1}), d_gate.view({T, -1}), d_gated.view({T, -1}),
                               r.attn.view({T, -1}), r.gate.view({T, -1}));
  } else {
    ops::linear_backward_input(s, d_attn.view({T, -1}), d_out, w_o_);
  }
  r.d_attn = d_attn;

  Tensor d_q_rot = Tensor::empty(r.q.shape(), dt, dev);
  Tensor d_k_rot = Tensor::empty(r.k.shape(), dt, dev);
  r.d_v = Tensor::empty(r.v.shape(), dt, dev);
  ops::attention_backward(s, d_q_rot, d_k_rot, r.d_v, d_attn, r.q_rot, r.k_rot, r.v, r.attn, r.lse, r.batch->cu_seqlens,
                          attention_for(*r.batch));
  const bool rotary = rope_.rotary_dim > 0;
  const Tensor& positions = r.batch->position_ids;
  if (options_.qk_norm) {
    r.d_q = Tensor::empty(r.q.shape(), dt, dev);
    r.d_k = Tensor::empty(r.k.shape(), dt, dev);
    if (rotary) {  // the norms' weight gradients come from the same pass: d(q after norm) is never stored
      ops::rope_rmsnorm_backward(s, r.d_q, g_q_norm_, d_q_rot, r.q, w_q_norm_, r.rstd_q, qk_norm_, positions, rope_);
      ops::rope_rmsnorm_backward(s, r.d_k, g_k_norm_, d_k_rot, r.k, w_k_norm_, r.rstd_k, qk_norm_, positions, rope_);
    } else {  // no rotation: the attention's gradient is d(q after norm), kept for backward_weight
      r.d_q_normed = d_q_rot;
      r.d_k_normed = d_k_rot;
      ops::rmsnorm_backward_input(s, r.d_q, r.d_q_normed, r.q, w_q_norm_, r.rstd_q, qk_norm_);
      ops::rmsnorm_backward_input(s, r.d_k, r.d_k_normed, r.k, w_k_norm_, r.rstd_k, qk_norm_);
    }
  } else {
    if (rotary) {  // in place: d_q_rot becomes d(q before rope)
      ops::rope_backward(s, d_q_rot, d_q_rot, positions, rope_);
      ops::rope_backward(s, d_k_rot, d_k_rot, positions, rope_);
    }
    r.d_q = d_q_rot;
    r.d_k = d_k_rot;
  }

  r.d_q_proj = r.d_q;
  if (options_.output_gate) {
    r.d_q_proj = Tensor::empty({T, nh, 2 * hd}, dt, dev);
    ops::copy_columns(s, r.d_q_proj.view({T * nh, 2 * hd}), 0, r.d_q.view({T * nh, hd}), 0, hd);
    ops::copy_columns(s, r.d_q_proj.view({T * nh, 2 * hd}), hd, d_gate.view({T * nh, hd}), 0, hd);
  }

  Tensor dx = Tensor::empty(r.x.shape(), dt, dev);
  ops::linear_backward_input(s, dx, r.d_q_proj.view({T, -1}), w_q_);
  ops::linear_backward_input_accumulate(s, dx, r.d_k.view({T, -1}), w_k_);
  ops::linear_backward_input_accumulate(s, dx, r.d_v.view({T, -1}), w_v_);
  return dx;
}

void GqaAttention::backward_weight(MixerRecord& record) const {
  AttentionRecord& r = as_attention(record);
  Stream& s = default_stream(r.x.device());
  const int64_t T = r.x.size(0);
  ops::linear_backward_weight(s, g_o_, r.d_out, (options_.output_gate ? r.gated : r.attn).view({T, -1}),
                              o_writer_.next());
  ops::linear_backward_weight(s, g_q_, r.d_q_proj.view({T, -1}), r.x, q_writer_.next());
  ops::linear_backward_weight(s, g_k_, r.d_k.view({T, -1}), r.x, k_writer_.next());
  ops::linear_backward_weight(s, g_v_, r.d_v.view({T, -1}), r.x, v_writer_.next());
  bias_grad(s, g_o_bias_, r.d_out);
  bias_grad(s, g_q_bias_, r.d_q_proj.view({T, -1}));
  bias_grad(s, g_k_bias_, r.d_k.view({T, -1}));
  bias_grad(s, g_v_bias_, r.d_v.view({T, -1}));
  if (options_.sinks) ops::attention_sinks_backward(s, g_sinks_, r.d_attn, r.attn, r.lse, w_sinks_);
  if (options_.qk_norm && rope_.rotary_dim == 0) {  // with rope, backward_input added them
    ops::rmsnorm_backward_weight(s, g_q_norm_, r.d_q_normed, r.q, r.rstd_q);
    ops::rmsnorm_backward_weight(s, g_k_norm_, r.d_k_normed, r.k, r.rstd_k);
  }
  r = AttentionRecord{};  // the record's work is done: free its activations now
}

}  // namespace moetrain::model
