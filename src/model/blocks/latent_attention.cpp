// defines: LatentAttention's parameters, forward and split backward (multi-head latent attention).
#include "model/blocks/latent_attention.h"

#include <cmath>

#include "core/device.h"
#include "core/error.h"
#include "model/blocks/cached_attention.h"
#include "model/precision.h"
#include "ops/columns.h"
#include "ops/gemm.h"

namespace moetrain::model {

namespace {

struct LatentRecord final : MixerRecord {
  Tensor x;                      // [T, H] block input (already normed)
  Tensor qa, rstd_qa, qa_n;      // q LoRA: [T, r_q] before and after its norm
  Tensor q;                      // [T, nh, qk] the projection, transformers' [nope | rope], rope dims rotated
  Tensor ckv;                    // [T, r_kv + dr] compressed latent and rotary key
  Tensor kv_lat, rstd_kv, kv_n;  // [T, r_kv] the latent before and after its norm
  Tensor kv;                     // [T, nh, nope + v] expanded keys and values
  Tensor K, V;                   // what attention saw beside q: [T, nh, qk] as [nope | rope] (rotated), [T, nh, v]
  Tensor attn, lse;              // [T, nh, v], [T, nh]
  const MicroBatch* batch = nullptr;
  // Kept by backward_input for backward_weight.
  Tensor d_out, dq, d_qa_n, d_qa, dkv, d_kv_n, d_ckv;
};

LatentRecord& as_latent(MixerRecord& record) {
  auto* r = dynamic_cast<LatentRecord*>(&record);
  MT_CHECK(r != nullptr, "latent attention block: given a record of another token mixer");
  return *r;
}

ParamSpec spec(const std::string& name, Shape shape, ParamRole role, int64_t layer) {
  ParamSpec s;
  s.name = name;
  s.shape = std::move(shape);
  s.role = role;
  s.layer = layer;
  s.init = s.is_matrix() ? ParamInit::Normal : ParamInit::Ones;
  return s;
}

// [rows, cols] view of a contiguous tensor whose last dimension is cols.
Tensor rows_of(const Tensor& t, int64_t cols) { return t.view({-1, cols}); }

}  // namespace

std::vector<ParamSpec> LatentAttention::param_specs(const LatentAttentionOptions& o, const std::string& prefix,
                                                    int64_t layer) {
  const int64_t h = o.hidden_size, nh = o.num_heads;
  std::vector<ParamSpec> specs;
  if (o.q_lora_rank > 0) {
    specs.push_back(spec(prefix + "q_a_proj", {o.q_lora_rank, h}, ParamRole::Dense, layer));
    specs.push_back(spec(prefix + "q_a_norm", {o.q_lora_rank}, ParamRole::Norm, layer));
    specs.push_back(spec(prefix + "q_b_proj", {nh * o.qk_head_dim(), o.q_lora_rank}, ParamRole::Dense, layer));
  } else {
    specs.push_back(spec(prefix + "q_proj", {nh * o.qk_head_dim(), h}, ParamRole::Dense, layer));
  }
  specs.push_back(spec(prefix + "kv_a_proj", {o.kv_lora_rank + o.qk_rope_head_dim, h}, ParamRole::Dense, layer));
  specs.push_back(spec(prefix + "kv_a_norm", {o.kv_lora_rank}, ParamRole::Norm, layer));
  specs.push_back(
      spec(prefix + "kv_b_proj", {nh * (o.qk_nope_head_dim + o.v_head_dim), o.kv_lora_rank}, ParamRole::Dense, layer));
  specs.push_back(spec(prefix + "o_proj", {h, nh * o.v_head_dim}, ParamRole::Dense, layer));
  return specs;
}

LatentAttention::LatentAttention(const LatentAttentionOptions& options, ParameterStore& store,
                                 const std::string& prefix)
    : options_(options) {
  const LatentAttentionOptions& o = options;
  MT_CHECK(o.hidden_size > 0 && o.num_heads > 0 && o.kv_lora_rank > 0 && o.qk_nope_head_dim > 0 &&
               o.qk_rope_head_dim > 0 && o.v_head_dim > 0 && o.q_lora_rank >= 0,
           "latent attention block: expected positive sizes (q_lora_rank >= 0) but found hidden {}, heads {}, q rank "
           "{}, kv rank {}, nope {}, rope {}, v {}",
           o.hidden_size, o.num_heads, o.q_lora_rank, o.kv_lora_rank, o.qk_nope_head_dim, o.qk_rope_head_dim,
           o.v_head_dim);
  MT_CHECK(o.rope.rotary_dim == o.qk_rope_head_dim,
           "latent attention block: the rope covers {} dims but the rotary key has {}", o.rope.rotary_dim,
           o.qk_rope_head_dim);
  MT_CHECK(o.rope.first_rotated_dim == 0,
           "latent attention block: the rope's first_rotated_dim is {}, expected 0 (the block places the rotation: "
           "the whole rotary key, the last {} dims of each query head)",
           o.rope.first_rotated_dim, o.qk_rope_head_dim);
  lora_norm_.eps = o.lora_norm_eps;
  key_rope_ = o.rope;
  query_rope_ = o.rope;
  query_rope_.first_rotated_dim = static_cast<int>(o.qk_nope_head_dim);
  attention_.softmax_scale =
      static_cast<float>(o.softmax_scale > 0.0 ? o.softmax_scale : 1.0 / std::sqrt(double(o.qk_head_dim())));
  const auto bind = [&](const char* name, Tensor& w, Tensor& g) {
    w = store.weight(prefix + name);
    g = store.grad(prefix + name);
  };
  // A projection's weight gradient is written whole by its GEMM: left to that GEMM's first write of the step.
  const auto bind_projection = [&](const char* name, Tensor& w, Tensor& g, GradientWriter& writer) {
    bind(name, w, g);
    writer = GradientWriter(store, prefix + name);
  };
  if (o.q_lora_rank > 0) {
    bind_projection("q_a_proj", w_qa_, g_qa_, qa_writer_);
    bind("q_a_norm", w_qa_norm_, g_qa_norm_);
    bind_projection("q_b_proj", w_qb_, g_qb_, qb_writer_);
  } else {
    bind_projection("q_proj", w_q_, g_q_, q_writer_);
  }
  bind_projection("kv_a_proj", w_kva_, g_kva_, kva_writer_);
  bind("kv_a_norm", w_kva_norm_, g_kva_norm_);
  bind_projection("kv_b_proj", w_kvb_, g_kvb_, kvb_writer_);
  bind_projection("o_proj", w_o_, g_o_, o_writer_);
}

std::unique_ptr<MixerRecord> LatentAttention::new_record() const { return std::make_unique<LatentRecord>(); }

ops::AttentionParams LatentAttention::attention_for(const MicroBatch& batch) const {
  ops::AttentionParams params = attention_;
  params.max_seqlen = batch.max_document_length();
  return params;
}

Tensor LatentAttention::forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const {
  LatentRecord& r = as_latent(record);
  const LatentAttentionOptions& o = options_;
  Stream& s = default_stream(x.device());
  const int64_t T = x.size(0), nh = o.num_heads, qk = o.qk_head_dim(), nope = o.qk_nope_head_dim;
  const int64_t dr = o.qk_rope_head_dim, dv = o.v_head_dim, rkv = o.kv_lora_rank;
  const DType dt = x.dtype();
  const Device dev = x.device();
  r.x = x;
  r.batch = &batch;

  r.q = Tensor::empty({T, nh, qk}, dt, dev);
  if (o.q_lora_rank > 0) {
    r.qa = Tensor::empty({T, o.q_lora_rank}, dt, dev);
    r.rstd_qa = Tensor::empty({T}, statistics_dtype(dt), dev);
    r.qa_n = Tensor::empty({T, o.q_lora_rank}, dt, dev);
    ops::linear_forward(s, r.qa, x, w_qa_);
    ops::rmsnorm_forward(s, r.qa_n, r.rstd_qa, r.qa, w_qa_norm_, lora_norm_);
    ops::linear_forward(s, r.q.view({T, -1}), r.qa_n, w_qb_);
  } else {
    ops::linear_forward(s, r.q.view({T, -1}), x, w_q_);
  }

  r.ckv = Tensor::empty({T, rkv + dr}, dt, dev);
  ops::linear_forward(s, r.ckv, x, w_kva_);
  r.kv_lat = Tensor::empty({T, rkv}, dt, dev);
  ops::copy_columns(s, r.kv_lat, 0, r.ckv, 0, rkv);
  Tensor k_rot = Tensor::empty({T, 1, dr}, dt, dev);
  ops::copy_columns(s, k_rot, 0, r.ckv, rkv, dr);
  ops::rope_forward(s, k_rot, k_rot, batch.position_ids, key_rope_);
  r.rstd_kv = Tensor::empty({T}, statistics_dtype(dt), dev);
  r.kv_n = Tensor::empty({T, rkv}, dt, dev);
  ops::rmsnorm_forward(s, r.kv_n, r.rstd_kv, r.kv_lat, w_kva_norm_, lora_norm_);
  r.kv = Tensor::empty({T, nh, nope + dv}, dt, dev);
  ops::linear_forward(s, r.kv.view({T, -1}), r.kv_n, w_kvb_);

  // Queries and keys as [nope | rope] per head: the queries' rope dims rotate in place, the shared rotary key is
  // broadcast after each head's k_nope.
  ops::rope_forward(s, r.q, r.q, batch.position_ids, query_rope_);
  r.K = Tensor::empty({T, nh, qk}, dt, dev);
  ops::copy_columns(s, r.K, 0, r.kv, 0, nope);
  ops::copy_columns(s, rows_of(r.K, qk), nope, rows_of(k_rot, dr), 0, dr, nh);
  r.V = Tensor::empty({T, nh, dv}, dt, dev);
  ops::copy_columns(s, r.V, 0, r.kv, nope, dv);

  r.attn = Tensor::empty({T, nh, dv}, dt, dev);
  r.lse = Tensor::empty({T, nh}, statistics_dtype(dt), dev);
  attend(s, r.attn, r.lse, r.q, r.K, r.V, batch, attention_for(batch), this);
  Tensor out = Tensor::empty({T, o.hidden_size}, dt, dev);
  ops::linear_forward(s, out, r.attn.view({T, -1}), w_o_);
  return out;
}

Tensor LatentAttention::backward_input(MixerRecord& record, const Tensor& d_out) const {
  LatentRecord& r = as_latent(record);
  const LatentAttentionOptions& o = options_;
  Stream& s = default_stream(d_out.device());
  const int64_t T = d_out.size(0), nh = o.num_heads, qk = o.qk_head_dim(), nope = o.qk_nope_head_dim;
  const int64_t dr = o.qk_rope_head_dim, dv = o.v_head_dim, rkv = o.kv_lora_rank;
  const DType dt = d_out.dtype();
  const Device dev = d_out.device();
  r.d_out = d_out;
  Tensor d_attn = Tensor::empty({T, nh, dv}, dt, dev);
  ops::linear_backward_input(s, d_attn.view({T, -1}), d_out, w_o_);
  r.dq = Tensor::empty(r.q.shape(), dt, dev);
  Tensor dK = Tensor::empty(r.K.shape(), dt, dev);
  Tensor dV = Tensor::empty(r.V.shape(), dt, dev);
  ops::attention_backward(s, r.dq, dK, dV, d_attn, r.q, r.K, r.V, r.attn, r.lse, r.batch->cu_seqlens,
                          attention_for(*r.batch));
  ops::rope_backward(s, r.dq, r.dq, r.batch->position_ids, query_rope_);  // the queries' rotation undone in place
  Tensor dx = Tensor::empty(r.x.shape(), dt, dev);
  if (o.q_lora_rank > 0) {
    r.d_qa_n = Tensor::empty(r.qa_n.shape(), dt, dev);
    ops::linear_backward_input(s, r.d_qa_n, r.dq.view({T, -1}), w_qb_);
    r.d_qa = Tensor::empty(r.qa.shape(), dt, dev);
    ops::rmsnorm_backward_input(s, r.d_qa, r.d_qa_n, r.qa, w_qa_norm_, r.rstd_qa, lora_norm_);
    ops::linear_backward_input(s, dx, r.d_qa, w_qa_);
  } else {
    ops::linear_backward_input(s, dx, r.dq.view({T, -1}), w_q_);
  }

  // Keys and values: the expanded [k_nope | v] per head, and the shared rotary key summed over the heads.
  r.dkv = Tensor::empty(r.kv.shape(), dt, dev);
  ops::copy_columns(s, r.dkv, 0, dK, 0, nope);
  ops::copy_columns(s, r.dkv, nope, dV, 0, dv);
  Tensor dk_rot = Tensor::empty({T, 1, dr}, dt, dev);
  ops::sum_repeated_columns(s, rows_of(dk_rot, dr), 0, rows_of(dK, qk), nope, dr, nh);
  ops::rope_backward(s, dk_rot, dk_rot, r.batch->position_ids, key_rope_);
  r.d_kv_n = Tensor::empty(r.kv_n.shape(), dt, dev);
  ops::linear_backward_input(s, r.d_kv_n, r.dkv.view({T, -1}), w_kvb_);
  Tensor d_kv_lat = Tensor::empty(r.kv_lat.shape(), dt, dev);
  ops::rmsnorm_backward_input(s, d_kv_lat, r.d_kv_n, r.kv_lat, w_kva_norm_, r.rstd_kv, lora_norm_);
  r.d_ckv = Tensor::empty(r.ckv.shape(), dt, dev);
  ops::copy_columns(s, r.d_ckv, 0, d_kv_lat, 0, rkv);
  ops::copy_columns(s, r.d_ckv, rkv, dk_rot, 0, dr);
  ops::linear_backward_input_accumulate(s, dx, r.d_ckv, w_kva_);
  return dx;
}

void LatentAttention::backward_weight(MixerRecord& record) const {
  LatentRecord& r = as_latent(record);
  Stream& s = default_stream(r.x.device());
  const int64_t T = r.x.size(0);
  ops::linear_backward_weight(s, g_o_, r.d_out, r.attn.view({T, -1}), o_writer_.next());
  ops::linear_backward_weight(s, g_kvb_, r.dkv.view({T, -1}), r.kv_n, kvb_writer_.next());
  ops::rmsnorm_backward_weight(s, g_kva_norm_, r.d_kv_n, r.kv_lat, r.rstd_kv);
  ops::linear_backward_weight(s, g_kva_, r.d_ckv, r.x, kva_writer_.next());
  if (options_.q_lora_rank > 0) {
    ops::linear_backward_weight(s, g_qb_, r.dq.view({T, -1}), r.qa_n, qb_writer_.next());
    ops::rmsnorm_backward_weight(s, g_qa_norm_, r.d_qa_n, r.qa, r.rstd_qa);
    ops::linear_backward_weight(s, g_qa_, r.d_qa, r.x, qa_writer_.next());
  } else {
    ops::linear_backward_weight(s, g_q_, r.dq.view({T, -1}), r.x, q_writer_.next());
  }
  r = LatentRecord{};  // the record's work is done: free its activations now
}

}  // namespace moetrain::model
