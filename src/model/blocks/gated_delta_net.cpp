// defines: GatedDeltaNet's parameters, forward and split backward. The weight gradients the fused ops produce in the
// input pass (the conv's, the gates' A_log and dt_bias, the output norm's) go to zeroed scratch tensors there and are
// added to the gradients in backward_weight, so every parameter's gradient is written in backward_weight alone.
#include "model/blocks/gated_delta_net.h"

#include <cmath>
#include <optional>

#include "core/device.h"
#include "core/error.h"
#include "model/decode_cache.h"
#include "model/precision.h"
#include "ops/columns.h"
#include "ops/elementwise.h"
#include "ops/gated_delta.h"
#include "ops/gemm.h"

namespace moetrain::model {

namespace {

// transformers' l2norm (and flash-linear-attention's) of q and k: x * rsqrt(sum(x^2) + 1e-6).
constexpr float kL2NormEps = 1e-6f;

struct GatedDeltaRecord final : MixerRecord {
  Tensor x;                         // [T, H] block input (already normed)
  Tensor qkv;                       // in_proj_qkv's output [T, C]
  Tensor q, k, v;                   // split: [T, Hk, dk], [T, Hk, dk], [T, Hv, dv], in the rule's dtype
  Tensor q_norm, k_norm;            // L2-normalised q and k (the rule's dtype)
  Tensor z, a, b;                   // [T, Hv dv], [T, Hv], [T, Hv]
  Tensor g, beta;                   // the gates [T, Hv]
  Tensor core;                      // the rule's output [T, Hv, dv]
  ops::GatedDeltaSaved rule_saved;  // the rule's forward intermediates, so its backward does not recompute them
  Tensor normed, rstd;              // the gated norm's output [T, Hv, dv] and its rstd [T Hv]
  const MicroBatch* batch = nullptr;
  // Kept by backward_input for backward_weight.
  Tensor d_out, d_qkv, d_z, d_a, d_b;
  Tensor d_conv_w, d_a_log, d_dt_bias, d_norm_w;  // scratch weight gradients
};

GatedDeltaRecord& as_gated_delta(MixerRecord& record) {
  auto* r = dynamic_cast<GatedDeltaRecord*>(&record);
  MT_CHECK(r != nullptr, "gated delta net block: given a record of another token mixer");
  return *r;
}

}  // namespace

std::vector<ParamSpec> GatedDeltaNet::param_specs(const GatedDeltaNetOptions& o, const std::string& prefix,
                                                  int64_t layer) {
  const int64_t h = o.hidden_size, c = 2 * o.num_key_heads * o.key_head_dim + o.num_value_heads * o.value_head_dim;
  const int64_t value_dim = o.num_value_heads * o.value_head_dim;
  std::vector<ParamSpec> specs;
  const auto add = [&](const char* name, Shape shape, ParamRole role, ParamInit init) {
    ParamSpec spec;
    spec.name = prefix + name;
    spec.shape = std::move(shape);
    spec.role = role;
    spec.layer = layer;
    spec.init = init;
    specs.push_back(std::move(spec));
  };
  add("in_proj_qkv", {c, h}, ParamRole::Dense, ParamInit::Normal);
  add("in_proj_z", {value_dim, h}, ParamRole::Dense, ParamInit::Normal);
  add("in_proj_a", {o.num_value_heads, h}, ParamRole::Dense, ParamInit::Normal);
  add("in_proj_b", {o.num_value_heads, h}, ParamRole::Dense, ParamInit::Normal);
  add("conv", {c, o.conv_kernel}, ParamRole::Dense, ParamInit::Normal);
  // As transformers starts them: A_log at log(U(0.01, 16)), dt_bias at 1.
  add("A_log", {o.num_value_heads}, ParamRole::Dense, ParamInit::LogUniform);
  specs.back().fp32_pin = "A_log";
  add("dt_bias", {o.num_value_heads}, ParamRole::Dense, ParamInit::Ones);
  specs.back().fp32_pin = "dt_bias";
  add("norm", {o.value_head_dim}, ParamRole::Norm, ParamInit::Ones);
  add("out_proj", {h, value_dim}, ParamRole::Dense, ParamInit::Normal);
  return specs;
}

GatedDeltaNet::GatedDeltaNet(const GatedDeltaNetOptions& options, ParameterStore& store, const std::string& prefix)
    : options_(options) {
  MT_CHECK(options.hidden_size > 0 && options.num_key_heads > 0 && options.num_value_heads > 0 &&
               options.num_value_heads % options.num_key_heads == 0 && options.key_head_dim > 0 &&
               options.value_head_dim > 0 && options.conv_kernel > 0,
           "gated delta net block: {} key heads of dim {}, {} value heads of dim {}, conv kernel {}: expected positive "
           "sizes and value heads a multiple of key heads",
           options.num_key_heads, options.key_head_dim, options.num_value_heads, options.value_head_dim,
           options.conv_kernel);
  MT_CHECK(options.norm_eps > 0.0f, "gated delta net block: norm eps must be positive but is {}", options.norm_eps);
  scale_ = static_cast<float>(1.0 / std::sqrt(double(options.key_head_dim)));
  const auto bind = [&](const char* name, Tensor& w, Tensor& g) {
    w = store.weight(prefix + name);
    g = store.grad(prefix + name);
  };
  bind("in_proj_qkv", w_qkv_, g_qkv_);
  bind("in_proj_z", w_z_, g_z_);
  bind("in_proj_a", w_a_, g_a_);
  bind("in_proj_b", w_b_, g_b_);
  // The projections' weight gradients are written whole by their GEMMs: left to each one's first write of the step.
  qkv_writer_ = GradientWriter(store, prefix + "in_proj_qkv"), z_writer_ = GradientWriter(store, prefix + "in_proj_z");
  a_writer_ = GradientWriter(store, prefix + "in_proj_a"), b_writer_ = GradientWriter(store, prefix + "in_proj_b");
  out_writer_ = GradientWriter(store, prefix + "out_proj");
  bind("conv", w_conv_, g_conv_);
  bind("A_log", w_a_log_, g_a_log_);
  bind("dt_bias", w_dt_bias_, g_dt_bias_);
  bind("norm", w_norm_, g_norm_);
  bind("out_proj", w_out_, g_out_);
}

int64_t GatedDeltaNet::conv_channels() const {
  return 2 * options_.num_key_heads * options_.key_head_dim + options_.num_value_heads * options_.value_head_dim;
}

std::unique_ptr<MixerRecord> GatedDeltaNet::new_record() const { return std::make_unique<GatedDeltaRecord>(); }

GatedDeltaNet::DecodeState GatedDeltaNet::decode_state(DecodeCache& cache, int64_t channels, DType dtype,
                                                       Device device) const {
  const int64_t rows = cache.sequences(), hv = options_.num_value_heads;
  const Shape inputs{rows, cache.capacity(), channels}, rule{rows, hv, options_.key_head_dim, options_.value_head_dim};
  std::vector<Tensor>& held = cache.state(this, [&] {
    // The recurrent state in the gates' dtype (f32 under bf16 compute), as the kernels keep it.
    return std::vector<Tensor>{Tensor::zeros(inputs, dtype, device),
                               Tensor::zeros(rule, statistics_dtype(dtype), device)};
  });
  MT_CHECK(held.size() == 2 && held[0].shape() == inputs && held[1].shape() == rule && held[0].dtype() == dtype,
           "gated delta net: its decoding state is not the {} conv inputs and {} states it keeps", shape_str(inputs),
           shape_str(rule));
  return {held[0], held[1]};
}

// The conv's inputs of every sequence so far: the prefill's prompts (document b is sequence b), or a step's token b
// at row lengths[b] - 1 of sequence b.
void GatedDeltaNet::keep_conv_inputs(const DecodeState& state, const Tensor& qkv, const MicroBatch& batch) const {
  const DecodeCache& cache = *batch.decode;
  const int32_t* len = cache.lengths().data<int32_t>();
  if (cache.phase() == DecodeCache::Phase::kStep) {
    MT_CHECK(qkv.size(0) == cache.sequences(),
             "gated delta net (decode step): the batch holds {} tokens but the decode cache {} sequences", qkv.size(0),
             cache.sequences());
    for (int64_t b = 0; b < cache.sequences(); ++b)
      state.conv_inputs.select(b).slice(len[b] - 1, len[b]).copy_from(qkv.slice(b, b + 1));
    return;
  }
  MT_CHECK(batch.num_documents() == cache.sequences(),
           "gated delta net (prefill): the batch holds {} documents but the decode cache {} sequences",
           batch.num_documents(), cache.sequences());
  const int32_t* cu = batch.cu_seqlens_host.data<int32_t>();
  for (int64_t b = 0; b < cache.sequences(); ++b)
    state.conv_inputs.select(b).slice(0, cu[b + 1] - cu[b]).copy_from(qkv.slice(cu[b], cu[b + 1]));
}

Tensor GatedDeltaNet::forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const {
  GatedDeltaRecord& r = as_gated_delta(record);
  Stream& s = default_stream(x.device());
  const int64_t T = x.size(0), hk = options_.num_key_heads, hv = options_.num_value_heads;
  const int64_t dk = options_.key_head_dim, dv = options_.value_head_dim, c = conv_channels();
  const DType dt = x.dtype();
  const Device dev = x.device();
  r.x = x;
  r.batch = &batch;

  r.qkv = Tensor::empty({T, c}, dt, dev);
  ops::linear_forward(s, r.qkv, x, w_qkv_);
  // The conv's output is only split into q, k and v: the record keeps those, not it.
  const Tensor conv_out = Tensor::empty({T, c}, dt, dev);
  std::optional<DecodeState> decoding;
  if (batch.decode != nullptr) {
    decoding = decode_state(*batch.decode, c, dt, dev);
    keep_conv_inputs(*decoding, r.qkv, batch);
  }
  if (decoding && batch.decode->phase() == DecodeCache::Phase::kStep) {
    ops::causal_conv1d_silu_decode(s, conv_out, decoding->conv_inputs, w_conv_, batch.decode->lengths());
  } else {
    ops::causal_conv1d_silu_forward(s, conv_out, r.qkv, w_conv_, batch.cu_seqlens);
  }
  // The conv's channels are q (Hk dk), k (Hk dk), then v (Hv dv), as transformers splits them. The rule runs in the
  // gates' dtype, f32 under bf16 compute, as transformers runs it under autocast: q, k and v leave the conv rounded
  // to bf16, then q and k are L2-normalised in f32 and nothing is rounded until the rule's output.
  const DType rule_dt = statistics_dtype(dt);
  const Tensor conv = rule_dt == dt ? conv_out : Tensor::empty({T, c}, rule_dt, dev);
  if (rule_dt != dt) ops::cast(s, conv, conv_out);
  r.q = Tensor::empty({T, hk, dk}, rule_dt, dev);
  r.k = Tensor::empty({T, hk, dk}, rule_dt, dev);
  r.v = Tensor::empty({T, hv, dv}, rule_dt, dev);
  ops::copy_columns(s, r.q.view({T, -1}), 0, conv, 0, hk * dk);
  ops::copy_columns(s, r.k.view({T, -1}), 0, conv, hk * dk, hk * dk);
  ops::copy_columns(s, r.v.view({T, -1}), 0, conv, 2 * hk * dk, hv * dv);
  r.q_norm = Tensor::empty(r.q.shape(), rule_dt, dev);
  r.k_norm = Tensor::empty(r.k.shape(), rule_dt, dev);
  ops::l2norm_forward(s, r.q_norm.view({T * hk, dk}), r.q.view({T * hk, dk}), kL2NormEps);
  ops::l2norm_forward(s, r.k_norm.view({T * hk, dk}), r.k.view({T * hk, dk}), kL2NormEps);

  r.z = Tensor::empty({T, hv * dv}, dt, dev);
  r.a = Tensor::empty({T, hv}, dt, dev);
  r.b = Tensor::empty({T, hv}, dt, dev);
  ops::linear_forward(s, r.z, x, w_z_);
  ops::linear_forward(s, r.a, x, w_a_);
  ops::linear_forward(s, r.b, x, w_b_);
  // The gates stay in f32 under bf16 compute (as transformers computes g in f32); a, b are activations.
  r.g = Tensor::empty({T, hv}, statistics_dtype(dt), dev);
  r.beta = Tensor::empty({T, hv}, statistics_dtype(dt), dev);
  ops::gated_delta_gates_forward(s, r.g, r.beta, r.a, r.b, w_a_log_, w_dt_bias_);

  r.core = Tensor::empty({T, hv, dv}, dt, dev);
  const Tensor core = rule_dt == dt ? r.core : Tensor::empty({T, hv, dv}, rule_dt, dev);
  if (!decoding) {
    ops::gated_delta_rule_forward(s, core, r.q_norm, r.k_norm, r.v, r.g, r.beta, batch.cu_seqlens, scale_,
                                  &r.rule_saved);
  } else if (batch.decode->phase() == DecodeCache::Phase::kStep) {
    ops::gated_delta_rule_decode(s, core, decoding->rule_state, r.q_norm, r.k_norm, r.v, r.g, r.beta, scale_);
  } else {
    ops::gated_delta_rule_prefill(s, core, decoding->rule_state, r.q_norm, r.k_norm, r.v, r.g, r.beta, batch.cu_seqlens,
                                  scale_);
  }
  if (rule_dt != dt) ops::cast(s, r.core, core);  // the output's one rounding (transformers' .to(initial_dtype))
  r.normed = Tensor::empty({T, hv, dv}, dt, dev);
  r.rstd = Tensor::empty({T * hv}, statistics_dtype(dt), dev);
  ops::gated_rmsnorm_forward(s, r.normed.view({T * hv, dv}), r.rstd, r.core.view({T * hv, dv}), r.z.view({T * hv, dv}),
                             w_norm_, options_.norm_eps);

  Tensor out = Tensor::empty({T, options_.hidden_size}, dt, dev);
  ops::linear_forward(s, out, r.normed.view({T, -1}), w_out_);
  return out;
}

Tensor GatedDeltaNet::backward_input(MixerRecord& record, const Tensor& d_out) const {
  GatedDeltaRecord& r = as_gated_delta(record);
  Stream& s = default_stream(d_out.device());
  const int64_t T = d_out.size(0), hk = options_.num_key_heads, hv = options_.num_value_heads;
  const int64_t dk = options_.key_head_dim, dv = options_.value_head_dim, c = conv_channels();
  const DType dt = d_out.dtype();
  const Device dev = d_out.device();
  r.d_out = d_out;

  Tensor d_normed = Tensor::empty({T, hv, dv}, dt, dev);
  ops::linear_backward_input(s, d_normed.view({T, -1}), d_out, w_out_);
  Tensor d_core = Tensor::empty({T, hv, dv}, dt, dev);
  r.d_z = Tensor::empty({T, hv * dv}, dt, dev);
  r.d_norm_w = Tensor::zeros(g_norm_.shape(), g_norm_.dtype(), dev);
  ops::gated_rmsnorm_backward(s, d_core.view({T * hv, dv}), r.d_z.view({T * hv, dv}), r.d_norm_w,
                              d_normed.view({T * hv, dv}), r.core.view({T * hv, dv}), r.z.view({T * hv, dv}), w_norm_,
                              r.rstd, options_.norm_eps);

  // In the rule's dtype back to the conv's output, whose gradient is rounded once (the forward's mirror).
  const DType rule_dt = r.q.dtype();
  const Tensor d_core_rule = ops::in_dtype(s, d_core, rule_dt);
  Tensor d_q_norm = Tensor::empty(r.q.shape(), rule_dt, dev);
  Tensor d_k_norm = Tensor::empty(r.k.shape(), rule_dt, dev);
  Tensor d_v = Tensor::empty(r.v.shape(), rule_dt, dev);
  Tensor d_g = Tensor::empty(r.g.shape(), r.g.dtype(), dev);
  Tensor d_beta = Tensor::empty(r.beta.shape(), r.beta.dtype(), dev);
  ops::gated_delta_rule_backward(s, d_q_norm, d_k_norm, d_v, d_g, d_beta, d_core_rule, r.q_norm, r.k_norm, r.v, r.g,
                                 r.beta, r.batch->cu_seqlens, scale_, &r.rule_saved);
  r.rule_saved = {};  // its last use: give the memory back before the projections' backward

  r.d_a = Tensor::empty(r.a.shape(), dt, dev);
  r.d_b = Tensor::empty(r.b.shape(), dt, dev);
  r.d_a_log = Tensor::zeros(g_a_log_.shape(), g_a_log_.dtype(), dev);
  r.d_dt_bias = Tensor::zeros(g_dt_bias_.shape(), g_dt_bias_.dtype(), dev);
  ops::gated_delta_gates_backward(s, r.d_a, r.d_b, r.d_a_log, r.d_dt_bias, d_g, d_beta, r.a, r.b, w_a_log_, w_dt_bias_);

  // d(conv output) [T, C]: the L2 norms' input gradients of q and k, then v's.
  Tensor d_conv = Tensor::empty({T, c}, dt, dev);
  Tensor d_conv_rule = rule_dt == dt ? d_conv : Tensor::empty({T, c}, rule_dt, dev);
  Tensor d_q = Tensor::empty(r.q.shape(), rule_dt, dev);
  Tensor d_k = Tensor::empty(r.k.shape(), rule_dt, dev);
  ops::l2norm_backward(s, d_q.view({T * hk, dk}), d_q_norm.view({T * hk, dk}), r.q.view({T * hk, dk}), kL2NormEps);
  ops::l2norm_backward(s, d_k.view({T * hk, dk}), d_k_norm.view({T * hk, dk}), r.k.view({T * hk, dk}), kL2NormEps);
  ops::copy_columns(s, d_conv_rule, 0, d_q.view({T, -1}), 0, hk * dk);
  ops::copy_columns(s, d_conv_rule, hk * dk, d_k.view({T, -1}), 0, hk * dk);
  ops::copy_columns(s, d_conv_rule, 2 * hk * dk, d_v.view({T, -1}), 0, hv * dv);
  if (rule_dt != dt) ops::cast(s, d_conv, d_conv_rule);
  r.d_qkv = Tensor::empty({T, c}, dt, dev);
  r.d_conv_w = Tensor::zeros(g_conv_.shape(), g_conv_.dtype(), dev);
  ops::causal_conv1d_silu_backward(s, r.d_qkv, r.d_conv_w, d_conv, r.qkv, w_conv_, r.batch->cu_seqlens);

  // The input's gradient has four parts, one per projection, each a GEMM's output in the compute dtype. Under bf16
  // compute they are summed in f32 (the norm's backward reads either dtype), as autograd sums the bf16 gradients of
  // the four casts of one f32 input under autocast: three bf16 roundings fewer than a bf16 sum.
  const DType sum_dt = statistics_dtype(dt);
  Tensor dx = Tensor::empty(r.x.shape(), sum_dt, dev);
  Tensor partial = Tensor::empty(r.x.shape(), dt, dev);
  const std::pair<const Tensor*, const Tensor*> parts[] = {
      {&r.d_qkv, &w_qkv_}, {&r.d_z, &w_z_}, {&r.d_a, &w_a_}, {&r.d_b, &w_b_}};
  bool first = true;
  for (const auto& [d_y, w] : parts) {
    if (first && sum_dt == dt) {
      ops::linear_backward_input(s, dx, *d_y, *w);
    } else {
      ops::linear_backward_input(s, partial, *d_y, *w);
      if (first) {
        ops::cast(s, dx, partial);
      } else {
        ops::accumulate(s, dx, partial);
      }
    }
    first = false;
  }
  return dx;
}

void GatedDeltaNet::backward_weight(MixerRecord& record) const {
  GatedDeltaRecord& r = as_gated_delta(record);
  Stream& s = default_stream(r.x.device());
  const int64_t T = r.x.size(0);
  ops::linear_backward_weight(s, g_out_, r.d_out, r.normed.view({T, -1}), out_writer_.next());
  ops::linear_backward_weight(s, g_qkv_, r.d_qkv, r.x, qkv_writer_.next());
  ops::linear_backward_weight(s, g_z_, r.d_z, r.x, z_writer_.next());
  ops::linear_backward_weight(s, g_a_, r.d_a, r.x, a_writer_.next());
  ops::linear_backward_weight(s, g_b_, r.d_b, r.x, b_writer_.next());
  ops::accumulate(s, g_conv_, r.d_conv_w);
  ops::accumulate(s, g_a_log_, r.d_a_log);
  ops::accumulate(s, g_dt_bias_, r.d_dt_bias);
  ops::accumulate(s, g_norm_, r.d_norm_w);
  r = GatedDeltaRecord{};  // the record's work is done: free its activations now
}

}  // namespace moetrain::model
