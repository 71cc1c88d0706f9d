// Tests for the GQA attention block (model/blocks/attention.*) on three packed documents: its forward, input
// gradient and weight gradients are bitwise those of the CPU ops composed by hand (q/k norm on and off, partial and
// full rotary, a given softmax scale; GPT-OSS's biases, sinks and a sliding window shorter than a document); that
// composition's gradients in f64 match central differences (the sinks' and biases' included) and the block's f32
// results match it; a packed document gives what it gives alone; and every option the block does not run is refused
// by name.
#include "model/blocks/attention.h"

#include <cmath>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/batch.h"
#include "model/blocks/block_testing.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/bias.h"
#include "ops/columns.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "ops/norm.h"
#include "ops/rope.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using block_testing::BlockRun;
using block_testing::contains;
using block_testing::error_message;
using block_testing::expect_packed_documents_give_what_each_gives_alone;
using block_testing::expect_weight_gradients_accumulate;
using block_testing::fill_random;
using block_testing::packed_batch;
using block_testing::run_block;
using block_testing::values;
using block_testing::with_whole_pieces;
using testing::random_tensor;
using testing::relative_error;

constexpr int64_t kHidden = 16, kHeads = 4, kKvHeads = 2, kHeadDim = 8;
// Three documents, one of a single token: 4 + 1 + 4 tokens.
const std::vector<int32_t> kCuSeqlens{0, 4, 5, 9};
constexpr int64_t kTokens = 9;
constexpr int64_t kWindow = 3;  // shorter than two of the documents, longer than the third

struct AttentionCase {
  const char* name;
  bool qk_norm;
  int rotary_dim;        // 0: no rope; < head dim: partial rotary
  double softmax_scale;  // 0: the block's default 1 / sqrt(hd)
  bool gpt_oss = false;  // biases on q, k, v and o, a sink per head, a sliding window of kWindow
  bool qwen3_5 = false;  // the sigmoid output gate from q_proj and zero-centred q/k norms (1 + w)
};

void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

AttentionOptions options_for(const AttentionCase& c) {
  AttentionOptions o;
  o.hidden_size = kHidden;
  o.num_heads = kHeads;
  o.num_kv_heads = kKvHeads;
  o.head_dim = kHeadDim;
  o.qk_norm = c.qk_norm;
  o.norm_eps = 1e-6f;
  // theta 100: positions up to 3 turn the low-frequency pairs by a visible angle too.
  if (c.rotary_dim > 0) o.rope = ops::rope_default_params(c.rotary_dim, 100.0);
  o.softmax_scale = c.softmax_scale;
  o.qkv_bias = o.output_bias = o.sinks = c.gpt_oss;
  o.sliding_window = c.gpt_oss ? kWindow : 0;
  o.output_gate = o.qk_norm_zero_centered = c.qwen3_5;
  return o;
}

// Positions restarting in every document, written out here rather than taken from the batch.
Tensor positions_of(const std::vector<int32_t>& cu) {
  std::vector<int32_t> pos;
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int32_t t = cu[d]; t < cu[d + 1]; ++t) pos.push_back(t - cu[d]);
  return Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())});
}

// ---- The block's computation written directly with the CPU ops, in the dtype of its inputs (f32 or f64). ----

struct Weights {
  Tensor q, k, v, o, q_norm, k_norm, q_bias, k_bias, v_bias, o_bias, sinks;
};

Weights weights_of(const ParameterStore& store, const AttentionOptions& o, DType dtype) {
  const auto get = [&](const char* name) { return store.param(std::string("attn.") + name).to(dtype); };
  Weights w;
  w.q = get("q_proj"), w.k = get("k_proj"), w.v = get("v_proj"), w.o = get("o_proj");
  if (o.qk_norm) w.q_norm = get("q_norm"), w.k_norm = get("k_norm");
  if (o.qkv_bias) w.q_bias = get("q_bias"), w.k_bias = get("k_bias"), w.v_bias = get("v_bias");
  if (o.output_bias) w.o_bias = get("o_bias");
  if (o.sinks) w.sinks = get("sinks");
  return w;
}

void add_bias(const Tensor& y, const Tensor& bias) {
  if (bias.defined()) ops::bias_add(Stream::cpu(), y, bias);
}

// The gradient of a bias from zero (undefined without the bias).
Tensor bias_grad(const Tensor& bias, const Tensor& dy) {
  if (!bias.defined()) return Tensor();
  Tensor g = Tensor::zeros(bias.shape(), bias.dtype());
  ops::bias_backward(Stream::cpu(), g, dy);
  return g;
}

struct Forward {
  Tensor q_gate, gate, gated;  // output gate: q_proj's output [T, nh, 2 hd], the gate, attn * sigmoid(gate)
  Tensor q, k, v;              // projections [T, heads, hd]
  Tensor rstd_q, rstd_k;       // qk_norm
  Tensor q_normed, k_normed;
  Tensor q_rot, k_rot;  // what attention sees
  Tensor attn, lse, out;
};

ops::AttentionParams attention_params(const AttentionOptions& o) {
  ops::AttentionParams p;
  p.softmax_scale = static_cast<float>(o.softmax_scale > 0.0 ? o.softmax_scale : 1.0 / std::sqrt(double(o.head_dim)));
  p.sliding_window = static_cast<int>(o.sliding_window);
  return p;
}

Forward reference_forward(const AttentionOptions& o, const Weights& w, const Tensor& x, const Tensor& positions,
                          const Tensor& cu) {
  Stream& s = Stream::cpu();
  const int64_t T = x.size(0);
  const DType dt = x.dtype();
  Forward f;
  f.q = Tensor::empty({T, o.num_heads, o.head_dim}, dt);
  f.k = Tensor::empty({T, o.num_kv_heads, o.head_dim}, dt);
  f.v = Tensor::empty({T, o.num_kv_heads, o.head_dim}, dt);
  if (o.output_gate) {
    // q_proj's rows per head: the query, then its gate.
    const int64_t nh = o.num_heads, hd = o.head_dim;
    f.q_gate = Tensor::empty({T, nh, 2 * hd}, dt);
    f.gate = Tensor::empty({T, nh, hd}, dt);
    ops::linear_forward(s, f.q_gate.view({T, -1}), x, w.q);
    add_bias(f.q_gate.view({T, -1}), w.q_bias);
    ops::copy_columns(s, f.q.view({T * nh, hd}), 0, f.q_gate.view({T * nh, 2 * hd}), 0, hd);
    ops::copy_columns(s, f.gate.view({T * nh, hd}), 0, f.q_gate.view({T * nh, 2 * hd}), hd, hd);
  } else {
    ops::linear_forward(s, f.q.view({T, -1}), x, w.q);
    add_bias(f.q.view({T, -1}), w.q_bias);
  }
  ops::linear_forward(s, f.k.view({T, -1}), x, w.k);
  ops::linear_forward(s, f.v.view({T, -1}), x, w.v);
  add_bias(f.k.view({T, -1}), w.k_bias);
  add_bias(f.v.view({T, -1}), w.v_bias);
  if (o.qk_norm) {
    ops::RmsNormParams norm;
    norm.eps = o.norm_eps;
    norm.zero_centered = o.qk_norm_zero_centered;
    f.rstd_q = Tensor::empty({T * o.num_heads}, dt);
    f.rstd_k = Tensor::empty({T * o.num_kv_heads}, dt);
    f.q_normed = Tensor::empty(f.q.shape(), dt);
    f.k_normed = Tensor::empty(f.k.shape(), dt);
    ops::rmsnorm_forward(s, f.q_normed, f.rstd_q, f.q, w.q_norm, norm);
    ops::rmsnorm_forward(s, f.k_normed, f.rstd_k, f.k, w.k_norm, norm);
  } else {
    f.q_normed = f.q;
    f.k_normed = f.k;
  }
  if (o.rope.rotary_dim > 0) {
    f.q_rot = Tensor::empty(f.q.shape(), dt);
    f.k_rot = Tensor::empty(f.k.shape(), dt);
    ops::rope_forward(s, f.q_rot, f.q_normed, positions, o.rope);
    ops::rope_forward(s, f.k_rot, f.k_normed, positions, o.rope);
  } else {
    f.q_rot = f.q_normed;
    f.k_rot = f.k_normed;
  }
  f.attn = Tensor::empty({T, o.num_heads, o.head_dim}, dt);
  f.lse = Tensor::empty({T, o.num_heads}, dt);
  ops::attention_forward(s, f.attn, f.lse, f.q_rot, f.k_rot, f.v, cu, attention_params(o));
  if (o.sinks) ops::attention_sinks_forward(s, f.attn, f.lse, w.sinks);
  f.out = Tensor::empty({T, o.hidden_size}, dt);
  if (o.output_gate) {
    f.gated = Tensor::empty(f.attn.shape(), dt);
    ops::sigmoid_gate_forward(s, f.gated.view({T, -1}), f.attn.view({T, -1}), f.gate.view({T, -1}));
  }
  ops::linear_forward(s, f.out, (o.output_gate ? f.gated : f.attn).view({T, -1}), w.o);
  add_bias(f.out, w.o_bias);
  return f;
}

struct Gradients {
  Tensor dx, q, k, v, o, q_norm, k_norm, q_bias, k_bias, v_bias, o_bias, sinks;  // weight gradients from zero
};

Gradients reference_backward(const AttentionOptions& o, const Weights& w, const Forward& f, const Tensor& x,
                             const Tensor& d_out, const Tensor& positions, const Tensor& cu) {
  Stream& s = Stream::cpu();
  const int64_t T = x.size(0);
  const DType dt = x.dtype();
  Tensor d_attn = Tensor::empty(f.attn.shape(), dt);
  Tensor d_gate;
  if (o.output_gate) {
    Tensor d_gated = Tensor::empty(f.attn.shape(), dt);
    d_gate = Tensor::empty(f.attn.shape(), dt);
    ops::linear_backward_input(s, d_gated.view({T, -1}), d_out, w.o);
    ops::sigmoid_gate_backward(s, d_attn.view({T, -1}), d_gate.view({T, -1}), d_gated.view({T, -1}),
                               f.attn.view({T, -1}), f.gate.view({T, -1}));
  } else {
    ops::linear_backward_input(s, d_attn.view({T, -1}), d_out, w.o);
  }
  Tensor d_q_rot = Tensor::empty(f.q.shape(), dt), d_k_rot = Tensor::empty(f.k.shape(), dt);
  Tensor d_v = Tensor::empty(f.v.shape(), dt);
  ops::attention_backward(s, d_q_rot, d_k_rot, d_v, d_attn, f.q_rot, f.k_rot, f.v, f.attn, f.lse, cu,
                          attention_params(o));
  Gradients g;
  if (o.sinks) {
    g.sinks = Tensor::zeros(w.sinks.shape(), dt);
    ops::attention_sinks_backward(s, g.sinks, d_attn, f.attn, f.lse, w.sinks);
  }
  Tensor d_q_normed = d_q_rot, d_k_normed = d_k_rot;
  if (o.rope.rotary_dim > 0) {
    d_q_normed = Tensor::empty(f.q.shape(), dt);
    d_k_normed = Tensor::empty(f.k.shape(), dt);
    ops::rope_backward(s, d_q_normed, d_q_rot, positions, o.rope);
    ops::rope_backward(s, d_k_normed, d_k_rot, positions, o.rope);
  }
  Tensor d_q = d_q_normed, d_k = d_k_normed;
  if (o.qk_norm) {
    ops::RmsNormParams norm;
    norm.eps = o.norm_eps;
    norm.zero_centered = o.qk_norm_zero_centered;
    d_q = Tensor::empty(f.q.shape(), dt);
    d_k = Tensor::empty(f.k.shape(), dt);
    ops::rmsnorm_backward_input(s, d_q, d_q_normed, f.q, w.q_norm, f.rstd_q, norm);
    ops::rmsnorm_backward_input(s, d_k, d_k_normed, f.k, w.k_norm, f.rstd_k, norm);
    g.q_norm = Tensor::zeros(w.q_norm.shape(), dt);
    g.k_norm = Tensor::zeros(w.k_norm.shape(), dt);
    ops::rmsnorm_backward_weight(s, g.q_norm, d_q_normed, f.q, f.rstd_q);
    ops::rmsnorm_backward_weight(s, g.k_norm, d_k_normed, f.k, f.rstd_k);
  }
  // q_proj's output gradient: d_q, or per head d_q then d_gate.
  Tensor d_q_proj = d_q;
  if (o.output_gate) {
    const int64_t nh = o.num_heads, hd = o.head_dim;
    d_q_proj = Tensor::empty({T, nh, 2 * hd}, dt);
    ops::copy_columns(s, d_q_proj.view({T * nh, 2 * hd}), 0, d_q.view({T * nh, hd}), 0, hd);
    ops::copy_columns(s, d_q_proj.view({T * nh, 2 * hd}), hd, d_gate.view({T * nh, hd}), 0, hd);
  }
  // dx = dq Wq + dk Wk + dv Wv, summed in that order.
  g.dx = Tensor::empty(x.shape(), dt);
  Tensor partial = Tensor::empty(x.shape(), dt);
  ops::linear_backward_input(s, g.dx, d_q_proj.view({T, -1}), w.q);
  ops::linear_backward_input(s, partial, d_k.view({T, -1}), w.k);
  ops::accumulate(s, g.dx, partial);
  ops::linear_backward_input(s, partial, d_v.view({T, -1}), w.v);
  ops::accumulate(s, g.dx, partial);
  g.q = Tensor::zeros(w.q.shape(), dt);
  g.k = Tensor::zeros(w.k.shape(), dt);
  g.v = Tensor::zeros(w.v.shape(), dt);
  g.o = Tensor::zeros(w.o.shape(), dt);
  ops::linear_backward_weight(s, g.o, d_out, (o.output_gate ? f.gated : f.attn).view({T, -1}));
  ops::linear_backward_weight(s, g.q, d_q_proj.view({T, -1}), x);
  ops::linear_backward_weight(s, g.k, d_k.view({T, -1}), x);
  ops::linear_backward_weight(s, g.v, d_v.view({T, -1}), x);
  g.o_bias = bias_grad(w.o_bias, d_out);
  g.q_bias = bias_grad(w.q_bias, d_q_proj.view({T, -1}));
  g.k_bias = bias_grad(w.k_bias, d_k.view({T, -1}));
  g.v_bias = bias_grad(w.v_bias, d_v.view({T, -1}));
  return g;
}

// The optional parameters of the GPT-OSS options, as (name, gradient of the reference, weight) triples.
struct OptionalParam {
  const char* name;
  Tensor weight, grad;
};
std::vector<OptionalParam> optional_params(const Weights& w, const Gradients& g) {
  std::vector<OptionalParam> out;
  for (const OptionalParam& p :
       {OptionalParam{"q_bias", w.q_bias, g.q_bias}, OptionalParam{"k_bias", w.k_bias, g.k_bias},
        OptionalParam{"v_bias", w.v_bias, g.v_bias}, OptionalParam{"o_bias", w.o_bias, g.o_bias},
        OptionalParam{"sinks", w.sinks, g.sinks}})
    if (p.weight.defined()) out.push_back(p);
  return out;
}

// ---- The block. ----

class GqaAttentionBlock : public ::testing::TestWithParam<AttentionCase> {
 protected:
  void SetUp() override {
    options = options_for(GetParam());
    store = std::make_unique<ParameterStore>(with_whole_pieces(GqaAttention::param_specs(options, "attn.", 3)));
    fill_random(*store, 11, 0.25);
    Rng rng(12);
    x = random_tensor({kTokens, kHidden}, DType::F32, rng);
    d_out = random_tensor({kTokens, kHidden}, DType::F32, rng);
  }

  Tensor grad(const char* name) const { return store->grad(std::string("attn.") + name); }

  AttentionOptions options;
  std::unique_ptr<ParameterStore> store;
  Tensor x, d_out;
};

TEST_P(GqaAttentionBlock, ForwardAndEveryGradientAreBitwiseTheOpsComposedByHand) {
  const GqaAttention block(options, *store, "attn.");
  const MicroBatch batch = packed_batch(kCuSeqlens);
  const BlockRun run = run_block(block, x, d_out, batch);

  const Tensor positions = positions_of(kCuSeqlens);
  const Tensor cu = Tensor::from_vector(kCuSeqlens, {4});
  const Weights w = weights_of(*store, options, DType::F32);
  const Forward f = reference_forward(options, w, x, positions, cu);
  const Gradients g = reference_backward(options, w, f, x, d_out, positions, cu);

  EXPECT_EQ(values(run.out), values(f.out));
  EXPECT_EQ(values(run.dx), values(g.dx));
  EXPECT_EQ(values(grad("q_proj")), values(g.q));
  EXPECT_EQ(values(grad("k_proj")), values(g.k));
  EXPECT_EQ(values(grad("v_proj")), values(g.v));
  EXPECT_EQ(values(grad("o_proj")), values(g.o));
  if (options.qk_norm) {
    EXPECT_EQ(values(grad("q_norm")), values(g.q_norm));
    EXPECT_EQ(values(grad("k_norm")), values(g.k_norm));
  }
  for (const OptionalParam& p : optional_params(w, g)) EXPECT_EQ(values(grad(p.name)), values(p.grad)) << p.name;
}

// The composition by hand is what the block is held to, so its derivative is checked on its own: in f64 every
// gradient matches central differences of sum(out * d_out) (step 1e-6, relative error 1e-6: truncation ~1e-12 and
// rounding ~1e-10 are far below, see testing/test_data.h). The block's f32 results then sit within f32 rounding of
// the f64 ones: 1e-5 relative leaves ~20x margin over the at most 5e-7 seen for these sizes, and a wrong term (a
// missing rope backward, a norm gradient of the wrong tensor) is off by O(1).
TEST_P(GqaAttentionBlock, GradientsMatchFiniteDifferencesInF64AndTheBlockMatchesThemInF32) {
  const Tensor positions = positions_of(kCuSeqlens);
  const Tensor cu = Tensor::from_vector(kCuSeqlens, {4});
  Weights w = weights_of(*store, options, DType::F64);
  const Tensor x64 = x.to(DType::F64), d_out64 = d_out.to(DType::F64);
  const Forward f = reference_forward(options, w, x64, positions, cu);
  const Gradients g = reference_backward(options, w, f, x64, d_out64, positions, cu);
  const auto loss = [&] { return testing::dot(reference_forward(options, w, x64, positions, cu).out, d_out64); };
  std::vector<testing::GradientInput> inputs{
      {"x", x64, g.dx}, {"q_proj", w.q, g.q}, {"k_proj", w.k, g.k}, {"v_proj", w.v, g.v}, {"o_proj", w.o, g.o}};
  if (options.qk_norm) {
    inputs.push_back({"q_norm", w.q_norm, g.q_norm});
    inputs.push_back({"k_norm", w.k_norm, g.k_norm});
  }
  for (const OptionalParam& p : optional_params(w, g)) inputs.push_back({p.name, p.weight, p.grad});
  testing::expect_gradients_match(loss, inputs);

  const GqaAttention block(options, *store, "attn.");
  const MicroBatch batch = packed_batch(kCuSeqlens);
  const BlockRun run = run_block(block, x, d_out, batch);
  constexpr double kF32 = 1e-5;
  EXPECT_LT(relative_error(run.out, f.out), kF32);
  EXPECT_LT(relative_error(run.dx, g.dx), kF32);
  EXPECT_LT(relative_error(grad("q_proj"), g.q), kF32);
  EXPECT_LT(relative_error(grad("k_proj"), g.k), kF32);
  EXPECT_LT(relative_error(grad("v_proj"), g.v), kF32);
  EXPECT_LT(relative_error(grad("o_proj"), g.o), kF32);
  if (options.qk_norm) {
    EXPECT_LT(relative_error(grad("q_norm"), g.q_norm), kF32);
    EXPECT_LT(relative_error(grad("k_norm"), g.k_norm), kF32);
  }
  for (const OptionalParam& p : optional_params(w, g)) EXPECT_LT(relative_error(grad(p.name), p.grad), kF32) << p.name;
}

// Each document attends only to itself and its positions restart: its rows of the packed output, input gradient
// and the weight gradients' sum over documents are those of the documents run alone (the CPU ops are
// batch-invariant, so bitwise for the outputs; the weight gradients sum rows in another grouping, so within f32:
// 1e-6 relative against the ~1.2e-7 seen).
TEST_P(GqaAttentionBlock, PackedDocumentsGiveWhatEachGivesAlone) {
  const GqaAttention block(options, *store, "attn.");
  expect_packed_documents_give_what_each_gives_alone(block, *store, x, d_out, kCuSeqlens);
}

// backward_weight adds to the gradients (micro-batches sum into one gradient): two identical micro-batches give
// exactly twice one.
TEST_P(GqaAttentionBlock, WeightGradientsAccumulateOverMicroBatches) {
  const GqaAttention block(options, *store, "attn.");
  expect_weight_gradients_accumulate(block, *store, x, d_out, packed_batch(kCuSeqlens));
}

INSTANTIATE_TEST_SUITE_P(Options, GqaAttentionBlock,
                         ::testing::Values(AttentionCase{"QkNormPartialRotary", true, 4, 0.0},
                                           AttentionCase{"NoQkNormPartialRotary", false, 4, 0.0},
                                           AttentionCase{"QkNormFullRotaryGivenScale", true, 8, 0.2},
                                           AttentionCase{"NoQkNormNoRope", false, 0, 0.0},
                                           AttentionCase{"GptOssBiasesSinksWindow", false, 8, 0.0, true},
                                           AttentionCase{"Qwen3_5OutputGateZeroCenteredQkNorm", true, 4, 0.0, false,
                                                         true}),
                         [](const ::testing::TestParamInfo<AttentionCase>& info) { return info.param.name; });

TEST(GqaAttentionBlockSpecs, NameEveryWeightWithItsShapeRoleAndLayer) {
  AttentionOptions o = options_for({"", true, 4, 0.0});
  const auto specs = GqaAttention::param_specs(o, "layers.2.attn.", 2);
  ASSERT_EQ(specs.size(), 6u);
  const std::vector<std::string> names{"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"};
  const std::vector<Shape> shapes{{kHeads * kHeadDim, kHidden},
                                  {kKvHeads * kHeadDim, kHidden},
                                  {kKvHeads * kHeadDim, kHidden},
                                  {kHidden, kHeads * kHeadDim},
                                  {kHeadDim},
                                  {kHeadDim}};
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(specs[i].name, "layers.2.attn." + names[i]);
    EXPECT_EQ(specs[i].shape, shapes[i]) << names[i];
    EXPECT_EQ(specs[i].role, i < 4 ? ParamRole::Dense : ParamRole::Norm) << names[i];
    EXPECT_EQ(specs[i].init, i < 4 ? ParamInit::Normal : ParamInit::Ones) << names[i];
    EXPECT_EQ(specs[i].layer, 2) << names[i];
    EXPECT_TRUE(specs[i].pieces.empty()) << names[i];
  }
  o.qk_norm = false;
  EXPECT_EQ(GqaAttention::param_specs(o, "attn.", 0).size(), 4u);
  // Qwen3.5: q_proj emits the query and the gate (twice the rows), o_proj reads the heads; zero-centred norms start 0.
  o.qk_norm = o.output_gate = o.qk_norm_zero_centered = true;
  const auto gated = GqaAttention::param_specs(o, "attn.", 0);
  ASSERT_EQ(gated.size(), 6u);
  EXPECT_EQ(gated[0].shape, (Shape{2 * kHeads * kHeadDim, kHidden}));
  EXPECT_EQ(gated[3].shape, (Shape{kHidden, kHeads * kHeadDim}));
  EXPECT_EQ(gated[4].init, ParamInit::Zeros);
  EXPECT_EQ(gated[5].init, ParamInit::Zeros);
}

// Builds the block with one option changed on a store that holds every parameter it would read, so that only the
// refusal can make construction fail.
std::string refusal(void (*change)(AttentionOptions&)) {
  AttentionOptions o = options_for({"", true, 4, 0.0});
  change(o);
  ParameterStore store(with_whole_pieces(GqaAttention::param_specs(o, "attn.", 0)));
  return error_message([&] { GqaAttention block(o, store, "attn."); });
}

TEST(GqaAttentionBlockOptions, RefusesANegativeSlidingWindow) {
  const std::string m = refusal([](AttentionOptions& o) { o.sliding_window = -2; });
  EXPECT_TRUE(contains(m, "sliding_window") && contains(m, "-2")) << m;
}

TEST(GqaAttentionBlockOptions, RefusesOddRotaryDimAndHeadsNotAMultipleOfKvHeads) {
  std::string m = refusal([](AttentionOptions& o) {
    o.rope = ops::rope_default_params(6, 100.0);
    o.rope.rotary_dim = 5;
  });
  EXPECT_TRUE(contains(m, "rotary dim 5 must be even")) << m;
  m = refusal([](AttentionOptions& o) { o.num_kv_heads = 3; });
  EXPECT_TRUE(contains(m, "4 heads over 3 kv heads")) << m;
}

}  // namespace
}  // namespace moetrain::model
