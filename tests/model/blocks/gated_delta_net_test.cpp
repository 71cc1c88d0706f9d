// Tests for the Gated DeltaNet block (model/blocks/gated_delta_net.*): its parameters (names, shapes, roles, inits and
// the f32 pins of A_log and dt_bias), its forward and every gradient bitwise the ops composed by hand, that
// composition's gradients against finite differences in f64 (and the block's f32 results within f32 rounding of them),
// packed documents giving what each gives alone (the conv and the recurrence restart per document), weight gradients
// accumulating over micro-batches, and the refusal of inconsistent sizes.
#include "model/blocks/gated_delta_net.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "ops/columns.h"
#include "ops/elementwise.h"
#include "ops/gated_delta.h"
#include "ops/gemm.h"
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

// Two key heads shared by four value heads, a conv of 3 taps; three documents, one of a single token.
constexpr int64_t kHidden = 12, kKeyHeads = 2, kValueHeads = 4, kKeyDim = 4, kValueDim = 3, kKernel = 3;
constexpr int64_t kChannels = 2 * kKeyHeads * kKeyDim + kValueHeads * kValueDim;
const std::vector<int32_t> kCuSeqlens{0, 5, 6, 11};
constexpr int64_t kTokens = 11;
constexpr float kEps = 1e-6f;

GatedDeltaNetOptions options() {
  GatedDeltaNetOptions o;
  o.hidden_size = kHidden;
  o.num_key_heads = kKeyHeads;
  o.num_value_heads = kValueHeads;
  o.key_head_dim = kKeyDim;
  o.value_head_dim = kValueDim;
  o.conv_kernel = kKernel;
  o.norm_eps = kEps;
  return o;
}

// ---- The block's computation written directly with the CPU ops, in the dtype of its inputs (f32 or f64). ----

struct Weights {
  Tensor qkv, z, a, b, conv, a_log, dt_bias, norm, out;
};

Weights weights_of(const ParameterStore& store, DType dtype) {
  const auto get = [&](const char* name) { return store.param(std::string("gdn.") + name).to(dtype); };
  return {get("in_proj_qkv"), get("in_proj_z"), get("in_proj_a"), get("in_proj_b"), get("conv"),
          get("A_log"),       get("dt_bias"),   get("norm"),      get("out_proj")};
}

struct Forward {
  Tensor qkv, conv, q, k, v, qn, kn, z, a, b, g, beta, core, normed, rstd, out;
};

Forward reference_forward(const Weights& w, const Tensor& x, const Tensor& cu) {
  Stream& s = Stream::cpu();
  const int64_t T = x.size(0), kd = kKeyHeads * kKeyDim;
  const DType dt = x.dtype();
  Forward f;
  f.qkv = Tensor::empty({T, kChannels}, dt);
  ops::linear_forward(s, f.qkv, x, w.qkv);
  f.conv = Tensor::empty({T, kChannels}, dt);
  ops::causal_conv1d_silu_forward(s, f.conv, f.qkv, w.conv, cu);
  f.q = Tensor::empty({T, kKeyHeads, kKeyDim}, dt);
  f.k = Tensor::empty({T, kKeyHeads, kKeyDim}, dt);
  f.v = Tensor::empty({T, kValueHeads, kValueDim}, dt);
  ops::copy_columns(s, f.q.view({T, -1}), 0, f.conv, 0, kd);
  ops::copy_columns(s, f.k.view({T, -1}), 0, f.conv, kd, kd);
  ops::copy_columns(s, f.v.view({T, -1}), 0, f.conv, 2 * kd, kValueHeads * kValueDim);
  f.qn = Tensor::empty(f.q.shape(), dt);
  f.kn = Tensor::empty(f.k.shape(), dt);
  ops::l2norm_forward(s, f.qn.view({T * kKeyHeads, kKeyDim}), f.q.view({T * kKeyHeads, kKeyDim}), 1e-6f);
  ops::l2norm_forward(s, f.kn.view({T * kKeyHeads, kKeyDim}), f.k.view({T * kKeyHeads, kKeyDim}), 1e-6f);
  f.z = Tensor::empty({T, kValueHeads * kValueDim}, dt);
  f.a = Tensor::empty({T, kValueHeads}, dt);
  f.b = Tensor::empty({T, kValueHeads}, dt);
  ops::linear_forward(s, f.z, x, w.z);
  ops::linear_forward(s, f.a, x, w.a);
  ops::linear_forward(s, f.b, x, w.b);
  f.g = Tensor::empty({T, kValueHeads}, dt);
  f.beta = Tensor::empty({T, kValueHeads}, dt);
  ops::gated_delta_gates_forward(s, f.g, f.beta, f.a, f.b, w.a_log, w.dt_bias);
  f.core = Tensor::empty({T, kValueHeads, kValueDim}, dt);
  const float scale = static_cast<float>(1.0 / std::sqrt(double(kKeyDim)));
  ops::gated_delta_rule_forward(s, f.core, f.qn, f.kn, f.v, f.g, f.beta, cu, scale);
  f.normed = Tensor::empty(f.core.shape(), dt);
  f.rstd = Tensor::empty({T * kValueHeads}, dt);
  ops::gated_rmsnorm_forward(s, f.normed.view({T * kValueHeads, kValueDim}), f.rstd,
                             f.core.view({T * kValueHeads, kValueDim}), f.z.view({T * kValueHeads, kValueDim}), w.norm,
                             kEps);
  f.out = Tensor::empty({T, kHidden}, dt);
  ops::linear_forward(s, f.out, f.normed.view({T, -1}), w.out);
  return f;
}

struct Gradients {
  Tensor dx, qkv, z, a, b, conv, a_log, dt_bias, norm, out;  // weight gradients from zero
};

Gradients reference_backward(const Weights& w, const Forward& f, const Tensor& x, const Tensor& d_out,
                             const Tensor& cu) {
  Stream& s = Stream::cpu();
  const int64_t T = x.size(0), kd = kKeyHeads * kKeyDim, rows = T * kValueHeads;
  const DType dt = x.dtype();
  Gradients g;
  Tensor d_normed = Tensor::empty(f.core.shape(), dt);
  ops::linear_backward_input(s, d_normed.view({T, -1}), d_out, w.out);
  Tensor d_core = Tensor::empty(f.core.shape(), dt), d_z = Tensor::empty(f.z.shape(), dt);
  g.norm = Tensor::zeros(w.norm.shape(), dt);
  ops::gated_rmsnorm_backward(s, d_core.view({rows, kValueDim}), d_z.view({rows, kValueDim}), g.norm,
                              d_normed.view({rows, kValueDim}), f.core.view({rows, kValueDim}),
                              f.z.view({rows, kValueDim}), w.norm, f.rstd, kEps);
  Tensor d_qn = Tensor::empty(f.q.shape(), dt), d_kn = Tensor::empty(f.k.shape(), dt);
  Tensor d_v = Tensor::empty(f.v.shape(), dt), d_g = Tensor::empty(f.g.shape(), dt);
  Tensor d_beta = Tensor::empty(f.beta.shape(), dt);
  const float scale = static_cast<float>(1.0 / std::sqrt(double(kKeyDim)));
  ops::gated_delta_rule_backward(s, d_qn, d_kn, d_v, d_g, d_beta, d_core, f.qn, f.kn, f.v, f.g, f.beta, cu, scale);
  Tensor d_a = Tensor::empty(f.a.shape(), dt), d_b = Tensor::empty(f.b.shape(), dt);
  g.a_log = Tensor::zeros(w.a_log.shape(), dt);
  g.dt_bias = Tensor::zeros(w.dt_bias.shape(), dt);
  ops::gated_delta_gates_backward(s, d_a, d_b, g.a_log, g.dt_bias, d_g, d_beta, f.a, f.b, w.a_log, w.dt_bias);
  Tensor d_q = Tensor::empty(f.q.shape(), dt), d_k = Tensor::empty(f.k.shape(), dt);
  ops::l2norm_backward(s, d_q.view({T * kKeyHeads, kKeyDim}), d_qn.view({T * kKeyHeads, kKeyDim}),
                       f.q.view({T * kKeyHeads, kKeyDim}), 1e-6f);
  ops::l2norm_backward(s, d_k.view({T * kKeyHeads, kKeyDim}), d_kn.view({T * kKeyHeads, kKeyDim}),
                       f.k.view({T * kKeyHeads, kKeyDim}), 1e-6f);
  Tensor d_conv = Tensor::empty({T, kChannels}, dt);
  ops::copy_columns(s, d_conv, 0, d_q.view({T, -1}), 0, kd);
  ops::copy_columns(s, d_conv, kd, d_k.view({T, -1}), 0, kd);
  ops::copy_columns(s, d_conv, 2 * kd, d_v.view({T, -1}), 0, kValueHeads * kValueDim);
  Tensor d_qkv = Tensor::empty({T, kChannels}, dt);
  g.conv = Tensor::zeros(w.conv.shape(), dt);
  ops::causal_conv1d_silu_backward(s, d_qkv, g.conv, d_conv, f.qkv, w.conv, cu);
  // dx = d_qkv Wqkv + dz Wz + da Wa + db Wb, summed in that order.
  g.dx = Tensor::empty(x.shape(), dt);
  Tensor partial = Tensor::empty(x.shape(), dt);
  ops::linear_backward_input(s, g.dx, d_qkv, w.qkv);
  ops::linear_backward_input(s, partial, d_z, w.z);
  ops::accumulate(s, g.dx, partial);
  ops::linear_backward_input(s, partial, d_a, w.a);
  ops::accumulate(s, g.dx, partial);
  ops::linear_backward_input(s, partial, d_b, w.b);
  ops::accumulate(s, g.dx, partial);
  g.out = Tensor::zeros(w.out.shape(), dt);
  g.qkv = Tensor::zeros(w.qkv.shape(), dt);
  g.z = Tensor::zeros(w.z.shape(), dt);
  g.a = Tensor::zeros(w.a.shape(), dt);
  g.b = Tensor::zeros(w.b.shape(), dt);
  ops::linear_backward_weight(s, g.out, d_out, f.normed.view({T, -1}));
  ops::linear_backward_weight(s, g.qkv, d_qkv, x);
  ops::linear_backward_weight(s, g.z, d_z, x);
  ops::linear_backward_weight(s, g.a, d_a, x);
  ops::linear_backward_weight(s, g.b, d_b, x);
  return g;
}

// (name, weight, gradient) of every parameter.
struct Param {
  const char* name;
  Tensor weight, grad;
};
std::vector<Param> params_of(const Weights& w, const Gradients& g) {
  return {{"in_proj_qkv", w.qkv, g.qkv},     {"in_proj_z", w.z, g.z},  {"in_proj_a", w.a, g.a},
          {"in_proj_b", w.b, g.b},           {"conv", w.conv, g.conv}, {"A_log", w.a_log, g.a_log},
          {"dt_bias", w.dt_bias, g.dt_bias}, {"norm", w.norm, g.norm}, {"out_proj", w.out, g.out}};
}

// ---- The block. ----

class GatedDeltaNetBlock : public ::testing::Test {
 protected:
  void SetUp() override {
    store = std::make_unique<ParameterStore>(with_whole_pieces(GatedDeltaNet::param_specs(options(), "gdn.", 1)));
    fill_random(*store, 21, 0.3);
    // A_log around 0 (A around 1) and dt_bias around 1 from fill_random: decays exp(g) in (0.2, 0.6), so the state
    // carries over several tokens.
    Rng rng(22);
    x = random_tensor({kTokens, kHidden}, DType::F32, rng);
    d_out = random_tensor({kTokens, kHidden}, DType::F32, rng);
  }

  Tensor grad(const char* name) const { return store->grad(std::string("gdn.") + name); }

  std::unique_ptr<ParameterStore> store;
  Tensor x, d_out;
};

TEST(GatedDeltaNetBlockSpecs, NameEveryWeightWithItsShapeRoleInitAndPin) {
  const auto specs = GatedDeltaNet::param_specs(options(), "layers.1.linear_attn.", 1);
  const std::vector<std::string> names{"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv",
                                       "A_log",       "dt_bias",   "norm",      "out_proj"};
  const std::vector<Shape> shapes{{kChannels, kHidden},
                                  {kValueHeads * kValueDim, kHidden},
                                  {kValueHeads, kHidden},
                                  {kValueHeads, kHidden},
                                  {kChannels, kKernel},
                                  {kValueHeads},
                                  {kValueHeads},
                                  {kValueDim},
                                  {kHidden, kValueHeads * kValueDim}};
  ASSERT_EQ(specs.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(specs[i].name, "layers.1.linear_attn." + names[i]);
    EXPECT_EQ(specs[i].shape, shapes[i]);
    EXPECT_EQ(specs[i].layer, 1);
    EXPECT_EQ(specs[i].role, names[i] == "norm" ? ParamRole::Norm : ParamRole::Dense);
    EXPECT_EQ(specs[i].fp32_pin, names[i] == "A_log" || names[i] == "dt_bias" ? names[i] : "");
    EXPECT_TRUE(specs[i].pieces.empty());
  }
  EXPECT_EQ(specs[5].init, ParamInit::LogUniform);  // A_log = log(U(0.01, 16)), as transformers
  EXPECT_EQ(specs[6].init, ParamInit::Ones);        // dt_bias, as transformers
  EXPECT_EQ(specs[7].init, ParamInit::Ones);        // the gated norm scales by w (not zero-centred)
}

TEST_F(GatedDeltaNetBlock, ForwardAndEveryGradientAreBitwiseTheOpsComposedByHand) {
  const GatedDeltaNet block(options(), *store, "gdn.");
  const MicroBatch batch = packed_batch(kCuSeqlens);
  const BlockRun run = run_block(block, x, d_out, batch);

  const Tensor cu = Tensor::from_vector(kCuSeqlens, {4});
  const Weights w = weights_of(*store, DType::F32);
  const Forward f = reference_forward(w, x, cu);
  const Gradients g = reference_backward(w, f, x, d_out, cu);
  EXPECT_EQ(values(run.out), values(f.out));
  EXPECT_EQ(values(run.dx), values(g.dx));
  for (const Param& p : params_of(w, g)) {
    EXPECT_EQ(values(grad(p.name)), values(p.grad)) << p.name;
    EXPECT_GT(testing::dot(p.grad, p.grad), 0.0) << p.name;  // every gradient is there
  }
}

// The composition by hand is what the block is held to, so its derivative is checked on its own: in f64 every
// gradient matches central differences of sum(out * d_out) (step 1e-6, relative error 1e-6, as the other block tests).
// The block's f32 results then sit within f32 rounding of the f64 ones: 1e-5 relative (a few hundred f32 operations
// deep through the recurrence, each 6e-8; a wrong term is off by O(1)).
TEST_F(GatedDeltaNetBlock, GradientsMatchFiniteDifferencesInF64AndTheBlockMatchesThemInF32) {
  const Tensor cu = Tensor::from_vector(kCuSeqlens, {4});
  Weights w = weights_of(*store, DType::F64);
  const Tensor x64 = x.to(DType::F64), d_out64 = d_out.to(DType::F64);
  const Forward f = reference_forward(w, x64, cu);
  const Gradients g = reference_backward(w, f, x64, d_out64, cu);
  const auto loss = [&] { return testing::dot(reference_forward(w, x64, cu).out, d_out64); };
  std::vector<testing::GradientInput> inputs{{"x", x64, g.dx}};
  for (const Param& p : params_of(w, g)) inputs.push_back({p.name, p.weight, p.grad});
  testing::expect_gradients_match(loss, inputs);

  const GatedDeltaNet block(options(), *store, "gdn.");
  const MicroBatch batch = packed_batch(kCuSeqlens);
  const BlockRun run = run_block(block, x, d_out, batch);
  constexpr double kF32 = 1e-5;
  EXPECT_LT(relative_error(run.out, f.out), kF32);
  EXPECT_LT(relative_error(run.dx, g.dx), kF32);
  for (const Param& p : params_of(w, g)) EXPECT_LT(relative_error(grad(p.name), p.grad), kF32) << p.name;
}

// The conv and the recurrence restart at every document: its rows of the packed output and input gradient are those
// of the documents run alone, bitwise (the CPU ops are batch-invariant); the weight gradients sum rows in another
// grouping, so within f32: 1e-6 relative.
TEST_F(GatedDeltaNetBlock, PackedDocumentsGiveWhatEachGivesAlone) {
  const GatedDeltaNet block(options(), *store, "gdn.");
  expect_packed_documents_give_what_each_gives_alone(block, *store, x, d_out, kCuSeqlens);
}

// backward_weight adds to the gradients: two identical micro-batches give exactly twice one.
TEST_F(GatedDeltaNetBlock, WeightGradientsAccumulateOverMicroBatches) {
  const GatedDeltaNet block(options(), *store, "gdn.");
  expect_weight_gradients_accumulate(block, *store, x, d_out, packed_batch(kCuSeqlens));
}

TEST(GatedDeltaNetBlockOptions, RefusesValueHeadsNotAMultipleOfKeyHeadsAndNonPositiveSizes) {
  ParameterStore store(with_whole_pieces(GatedDeltaNet::param_specs(options(), "gdn.", 0)));
  GatedDeltaNetOptions o = options();
  o.num_value_heads = 3;
  std::string m = error_message([&] { GatedDeltaNet block(o, store, "gdn."); });
  EXPECT_TRUE(contains(m, "value heads a multiple of key heads")) << m;
  o = options();
  o.conv_kernel = 0;
  m = error_message([&] { GatedDeltaNet block(o, store, "gdn."); });
  EXPECT_TRUE(contains(m, "conv kernel 0")) << m;
  o = options();
  o.norm_eps = 0.0f;
  m = error_message([&] { GatedDeltaNet block(o, store, "gdn."); });
  EXPECT_TRUE(contains(m, "norm eps must be positive")) << m;
}

}  // namespace
}  // namespace moetrain::model
