// Tests for the gated MLP block (model/blocks/gated_mlp.*): a dense MLP is bitwise the CPU ops composed by hand and
// its output is down(silu(gate) * up) with the gate rows first; an expert bank (one expert with no rows) is bitwise
// each expert run alone as a dense MLP on its rows, and the empty expert's gradients stay zero; GPT-OSS's bank (biases,
// the clamped SwiGLU) likewise, with its output checked against the formula written out; bad options are refused;
// the weight gradients of several records at once (backward_weight_together) are their sum one by one, on an expert
// bank with an expert empty in some records, with biases, over a step's first writes; records holding their rows'
// token-side sources (ops::PermutedRows) give the bits of records holding the rows, and the two kinds do not mix.
#include "model/blocks/gated_mlp.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "ops/activation.h"
#include "ops/bias.h"
#include "ops/gemm.h"
#include "ops/permute.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using block_testing::contains;
using block_testing::error_message;
using block_testing::fill_random;
using block_testing::values;
using block_testing::with_whole_pieces;
using testing::random_tensor;

constexpr int64_t kHidden = 12, kWidth = 10;

GatedMlpOptions dense_options() {
  GatedMlpOptions o;
  o.hidden_size = kHidden;
  o.intermediate_size = kWidth;
  return o;
}

GatedMlpOptions bank_options(int64_t experts) {
  GatedMlpOptions o = dense_options();
  o.num_experts = experts;
  o.role = ParamRole::ExpertBank;
  return o;
}

// A dense gated MLP written with the CPU ops; weight gradients from zero. With biases (defined b_gate_up, b_down) and
// `clamped`, GPT-OSS's expert.
struct DenseReference {
  Tensor y, dx, g_gate_up, g_down, g_gate_up_bias, g_down_bias;
};

DenseReference dense_reference(const Tensor& x, const Tensor& d_y, const Tensor& w_gate_up, const Tensor& w_down,
                               const Tensor& b_gate_up = Tensor(), const Tensor& b_down = Tensor(),
                               const ops::ClampedSwigluParams* clamped = nullptr) {
  Stream& s = Stream::cpu();
  const int64_t rows = x.size(0), width = w_down.size(1), hidden = w_down.size(0);
  DenseReference r;
  Tensor gate_up = Tensor::empty({rows, 2 * width}, DType::F32), act = Tensor::empty({rows, width}, DType::F32);
  r.y = Tensor::empty({rows, hidden}, DType::F32);
  ops::linear_forward(s, gate_up, x, w_gate_up);
  if (b_gate_up.defined()) ops::bias_add(s, gate_up, b_gate_up);
  if (clamped) {
    ops::clamped_swiglu_forward(s, act, gate_up, *clamped);
  } else {
    ops::swiglu_forward(s, act, gate_up);
  }
  ops::linear_forward(s, r.y, act, w_down);
  if (b_down.defined()) ops::bias_add(s, r.y, b_down);
  Tensor d_act = Tensor::empty(act.shape(), DType::F32), d_gate_up = Tensor::empty(gate_up.shape(), DType::F32);
  r.dx = Tensor::empty(x.shape(), DType::F32);
  ops::linear_backward_input(s, d_act, d_y, w_down);
  if (clamped) {
    ops::clamped_swiglu_backward(s, d_gate_up, d_act, gate_up, *clamped);
  } else {
    ops::swiglu_backward(s, d_gate_up, d_act, gate_up);
  }
  ops::linear_backward_input(s, r.dx, d_gate_up, w_gate_up);
  r.g_gate_up = Tensor::zeros(w_gate_up.shape(), DType::F32);
  r.g_down = Tensor::zeros(w_down.shape(), DType::F32);
  ops::linear_backward_weight(s, r.g_down, d_y, act);
  ops::linear_backward_weight(s, r.g_gate_up, d_gate_up, x);
  if (b_gate_up.defined()) {
    r.g_gate_up_bias = Tensor::zeros(b_gate_up.shape(), DType::F32);
    r.g_down_bias = Tensor::zeros(b_down.shape(), DType::F32);
    ops::bias_backward(s, r.g_down_bias, d_y);
    ops::bias_backward(s, r.g_gate_up_bias, d_gate_up);
  }
  return r;
}

TEST(GatedMlpBlock, DenseForwardAndGradientsAreBitwiseTheOpsComposedByHand) {
  const GatedMlpOptions o = dense_options();
  ParameterStore store(with_whole_pieces(GatedMlp::param_specs(o, "mlp.", 0)));
  fill_random(store, 21, 0.3);
  Rng rng(22);
  const Tensor x = random_tensor({7, kHidden}, DType::F32, rng), d_y = random_tensor({7, kHidden}, DType::F32, rng);

  const GatedMlp mlp(o, store, "mlp.");
  EXPECT_FALSE(mlp.is_expert_bank());
  MlpRecord record;
  const Tensor y = mlp.forward(record, x, Tensor());
  const Tensor dx = mlp.backward_input(record, d_y);
  mlp.backward_weight(record);

  const DenseReference ref = dense_reference(x, d_y, store.param("mlp.gate_up"), store.param("mlp.down"));
  EXPECT_EQ(values(y), values(ref.y));
  EXPECT_EQ(values(dx), values(ref.dx));
  EXPECT_EQ(values(store.grad("mlp.gate_up")), values(ref.g_gate_up));
  EXPECT_EQ(values(store.grad("mlp.down")), values(ref.g_down));
}

// The layout the families rely on, checked without the swiglu op: gate_up's first I rows are the gate, the next I
// the up projection, y = down(silu(gate x) * up x). In f64 from the f32 values; 1e-5 relative is f32 rounding with
// margin, while swapping gate and up changes y by O(1).
TEST(GatedMlpBlock, DenseOutputIsDownOfSiluGateTimesUpWithGateRowsFirst) {
  const GatedMlpOptions o = dense_options();
  ParameterStore store(with_whole_pieces(GatedMlp::param_specs(o, "mlp.", 0)));
  fill_random(store, 23, 0.3);
  Rng rng(24);
  const int64_t rows = 5;
  const Tensor x = random_tensor({rows, kHidden}, DType::F32, rng);
  const GatedMlp mlp(o, store, "mlp.");
  MlpRecord record;
  const Tensor y = mlp.forward(record, x, Tensor());

  const std::vector<float> xs = values(x), wgu = values(store.param("mlp.gate_up")),
                           wd = values(store.param("mlp.down"));
  std::vector<double> expected(static_cast<size_t>(rows * kHidden), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> act(static_cast<size_t>(kWidth));
    for (int64_t i = 0; i < kWidth; ++i) {
      double gate = 0.0, up = 0.0;
      for (int64_t h = 0; h < kHidden; ++h) {
        gate += double(wgu[static_cast<size_t>(i * kHidden + h)]) * xs[static_cast<size_t>(r * kHidden + h)];
        up += double(wgu[static_cast<size_t>((kWidth + i) * kHidden + h)]) * xs[static_cast<size_t>(r * kHidden + h)];
      }
      act[static_cast<size_t>(i)] = gate / (1.0 + std::exp(-gate)) * up;
    }
    for (int64_t h = 0; h < kHidden; ++h)
      for (int64_t i = 0; i < kWidth; ++i)
        expected[static_cast<size_t>(r * kHidden + h)] +=
            double(wd[static_cast<size_t>(h * kWidth + i)]) * act[static_cast<size_t>(i)];
  }
  EXPECT_LT(testing::relative_error(y, Tensor::from_vector(expected, {rows, kHidden})), 1e-5);
}

// Four experts over ten expert-ordered rows, expert 1 with none: each expert's rows, input gradient and weight
// gradients are bitwise a dense MLP with that expert's weights on those rows (the grouped and the dense CPU GEMMs
// are both ascending dot products); the empty expert's gradients stay exactly zero.
TEST(GatedMlpBlock, ExpertBankIsEachExpertAsADenseMlpOnItsRowsWithAnEmptyExpert) {
  const int64_t experts = 4;
  const std::vector<int32_t> offsets{0, 3, 3, 8, 10};
  const int64_t rows = offsets.back();
  const GatedMlpOptions o = bank_options(experts);
  const auto specs = GatedMlp::param_specs(o, "experts.", 1);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].shape, (Shape{experts, 2 * kWidth, kHidden}));
  EXPECT_EQ(specs[1].shape, (Shape{experts, kHidden, kWidth}));
  EXPECT_EQ(specs[0].role, ParamRole::ExpertBank);
  ParameterStore store(with_whole_pieces(specs));
  fill_random(store, 31, 0.3);
  Rng rng(32);
  const Tensor x = random_tensor({rows, kHidden}, DType::F32, rng),
               d_y = random_tensor({rows, kHidden}, DType::F32, rng);

  const GatedMlp mlp(o, store, "experts.");
  EXPECT_TRUE(mlp.is_expert_bank());
  MlpRecord record;
  const Tensor y = mlp.forward(record, x, Tensor::from_vector(offsets, {experts + 1}));
  const Tensor dx = mlp.backward_input(record, d_y);
  mlp.backward_weight(record);

  const Tensor w_gate_up = store.param("experts.gate_up"), w_down = store.param("experts.down");
  const Tensor g_gate_up = store.grad("experts.gate_up"), g_down = store.grad("experts.down");
  for (int64_t e = 0; e < experts; ++e) {
    const int32_t begin = offsets[static_cast<size_t>(e)], end = offsets[static_cast<size_t>(e) + 1];
    if (begin == end) {
      for (float v : values(g_gate_up.select(e).clone())) ASSERT_EQ(v, 0.0f) << "empty expert " << e;
      for (float v : values(g_down.select(e).clone())) ASSERT_EQ(v, 0.0f) << "empty expert " << e;
      continue;
    }
    const DenseReference ref = dense_reference(x.slice(begin, end).clone(), d_y.slice(begin, end).clone(),
                                               w_gate_up.select(e).clone(), w_down.select(e).clone());
    EXPECT_EQ(values(y.slice(begin, end).clone()), values(ref.y)) << "expert " << e;
    EXPECT_EQ(values(dx.slice(begin, end).clone()), values(ref.dx)) << "expert " << e;
    EXPECT_EQ(values(g_gate_up.select(e).clone()), values(ref.g_gate_up)) << "expert " << e;
    EXPECT_EQ(values(g_down.select(e).clone()), values(ref.g_down)) << "expert " << e;
  }
}

TEST(GatedMlpBlock, GroupOffsetsMustBeGivenExactlyToAnExpertBank) {
  ParameterStore dense_store(with_whole_pieces(GatedMlp::param_specs(dense_options(), "mlp.", 0)));
  const GatedMlp dense(dense_options(), dense_store, "mlp.");
  ParameterStore bank_store(with_whole_pieces(GatedMlp::param_specs(bank_options(2), "experts.", 0)));
  const GatedMlp bank(bank_options(2), bank_store, "experts.");
  const Tensor x = Tensor::zeros({3, kHidden}, DType::F32);
  MlpRecord record;
  std::string m = error_message([&] { dense.forward(record, x, Tensor::from_vector<int32_t>({0, 3}, {2})); });
  EXPECT_TRUE(contains(m, "group offsets are given for a dense MLP")) << m;
  m = error_message([&] { bank.forward(record, x, Tensor()); });
  EXPECT_TRUE(contains(m, "group offsets are missing for an expert MLP")) << m;
}

GatedMlpOptions gpt_oss_bank_options(int64_t experts) {
  GatedMlpOptions o = bank_options(experts);
  o.activation = GatedActivation::ClampedSwiGlu;
  o.swiglu_limit = 0.5f;  // small, so that random pre-activations cross the clamps on both sides
  o.bias = true;
  return o;
}

// GPT-OSS's bank: the bias specs ([E, 2I], [E, H], zeros at init, in the bank's role), and the same per-expert
// bitwise composition as above with the biases and the clamped SwiGLU; the empty expert's bias gradients stay zero.
TEST(GatedMlpBlock, BiasedClampedBankIsEachExpertAsADenseMlpOnItsRows) {
  const int64_t experts = 3;
  const std::vector<int32_t> offsets{0, 4, 4, 9};
  const int64_t rows = offsets.back();
  const GatedMlpOptions o = gpt_oss_bank_options(experts);
  const auto specs = GatedMlp::param_specs(o, "experts.", 1);
  ASSERT_EQ(specs.size(), 4u);
  EXPECT_EQ(specs[2].name, "experts.gate_up_bias");
  EXPECT_EQ(specs[2].shape, (Shape{experts, 2 * kWidth}));
  EXPECT_EQ(specs[3].name, "experts.down_bias");
  EXPECT_EQ(specs[3].shape, (Shape{experts, kHidden}));
  for (size_t i = 2; i < 4; ++i) {
    EXPECT_EQ(specs[i].role, ParamRole::ExpertBank);
    EXPECT_EQ(specs[i].init, ParamInit::Zeros);
  }
  ParameterStore store(with_whole_pieces(specs));
  fill_random(store, 41, 0.4);
  Rng rng(42);
  const Tensor x = random_tensor({rows, kHidden}, DType::F32, rng),
               d_y = random_tensor({rows, kHidden}, DType::F32, rng);
  const GatedMlp mlp(o, store, "experts.");
  MlpRecord record;
  const Tensor y = mlp.forward(record, x, Tensor::from_vector(offsets, {experts + 1}));
  const Tensor dx = mlp.backward_input(record, d_y);
  mlp.backward_weight(record);

  ops::ClampedSwigluParams clamped;
  clamped.alpha = o.swiglu_alpha;
  clamped.limit = o.swiglu_limit;
  const auto param = [&](const char* name) { return store.param(std::string("experts.") + name); };
  const auto grad = [&](const char* name) { return store.grad(std::string("experts.") + name); };
  for (int64_t e = 0; e < experts; ++e) {
    const int32_t begin = offsets[static_cast<size_t>(e)], end = offsets[static_cast<size_t>(e) + 1];
    if (begin == end) {
      for (const char* name : {"gate_up", "down", "gate_up_bias", "down_bias"})
        for (float v : values(grad(name).select(e).clone())) ASSERT_EQ(v, 0.0f) << "empty expert " << e << " " << name;
      continue;
    }
    const DenseReference ref =
        dense_reference(x.slice(begin, end).clone(), d_y.slice(begin, end).clone(), param("gate_up").select(e).clone(),
                        param("down").select(e).clone(), param("gate_up_bias").select(e).clone(),
                        param("down_bias").select(e).clone(), &clamped);
    EXPECT_EQ(values(y.slice(begin, end).clone()), values(ref.y)) << "expert " << e;
    EXPECT_EQ(values(dx.slice(begin, end).clone()), values(ref.dx)) << "expert " << e;
    EXPECT_EQ(values(grad("gate_up").select(e).clone()), values(ref.g_gate_up)) << "expert " << e;
    EXPECT_EQ(values(grad("down").select(e).clone()), values(ref.g_down)) << "expert " << e;
    EXPECT_EQ(values(grad("gate_up_bias").select(e).clone()), values(ref.g_gate_up_bias)) << "expert " << e;
    EXPECT_EQ(values(grad("down_bias").select(e).clone()), values(ref.g_down_bias)) << "expert " << e;
  }
}

// Three records (different row counts; expert 1 empty in two of them, expert 3 empty in all) through the step's
// first-write protocol: backward_weight one by one, against backward_weight_together on a second store. The two
// differ only in the f32 summation order of each expert's rows (a record's partial sum added to the running gradient,
// or one running sum), a few units of f32 rounding (6e-8) relative; a misplaced row or a lost record moves the
// gradient by O(1). A dense MLP's records run one by one: the same bits.
TEST(GatedMlpBlock, WeightGradientsOfSeveralRecordsAtOnceAreTheirSum) {
  const int64_t experts = 4;
  const std::vector<std::vector<int32_t>> offsets{{0, 3, 3, 8, 8}, {0, 5, 6, 6, 6}, {0, 0, 0, 4, 4}};
  for (const bool bank : {true, false}) {
    SCOPED_TRACE(bank ? "expert bank" : "dense");
    const GatedMlpOptions o = bank ? gpt_oss_bank_options(experts) : dense_options();
    const std::string prefix = bank ? "experts." : "mlp.";
    ParameterStore one_by_one(with_whole_pieces(GatedMlp::param_specs(o, prefix, 0)));
    ParameterStore together(with_whole_pieces(GatedMlp::param_specs(o, prefix, 0)));
    fill_random(one_by_one, 51, 0.3);
    fill_random(together, 51, 0.3);
    const GatedMlp mlp_a(o, one_by_one, prefix), mlp_b(o, together, prefix);
    for (ParameterStore* store : {&one_by_one, &together}) store->begin_accumulation();
    Rng rng(52);
    std::vector<MlpRecord> a(offsets.size()), b(offsets.size());
    for (size_t i = 0; i < offsets.size(); ++i) {
      const int64_t rows = offsets[i].back();
      const Tensor x = random_tensor({rows, kHidden}, DType::F32, rng);
      const Tensor d_y = random_tensor({rows, kHidden}, DType::F32, rng);
      const Tensor group_offsets = bank ? Tensor::from_vector(offsets[i], {experts + 1}) : Tensor();
      mlp_a.forward(a[i], x, group_offsets);
      mlp_b.forward(b[i], x, group_offsets);
      mlp_a.backward_input(a[i], d_y);
      mlp_b.backward_input(b[i], d_y);
      GatedMlp::keep_for_weight_work(b[i]);
      mlp_a.backward_weight(a[i]);
    }
    mlp_b.backward_weight_together({&b[0], &b[1], &b[2]});
    for (ParameterStore* store : {&one_by_one, &together}) store->end_accumulation();
    for (const MlpRecord& r : b) EXPECT_FALSE(r.x.defined() || r.d_y.defined() || r.act.defined());
    for (const ParamSpec& spec : one_by_one.specs()) {
      const Tensor want = one_by_one.grad(spec.name), got = together.grad(spec.name);
      if (bank) {
        EXPECT_LT(testing::relative_error(got, want), 1e-6) << spec.name;
      } else {
        EXPECT_EQ(values(got), values(want)) << spec.name;
      }
    }
    if (bank) {  // expert 3 has no row in any record: its gradients are zeros (overwritten, never read)
      for (float v : values(together.grad("experts.gate_up").select(3).clone())) ASSERT_EQ(v, 0.0f);
      for (float v : values(together.grad("experts.down_bias").select(3).clone())) ASSERT_EQ(v, 0.0f);
    }
  }
}

// Records of a GPT-OSS bank (biases: the down bias's gradient reads d_y too) whose x and d_y are a routing plan's
// rows of token-side tensors: held as the rows, or as their sources (what PreNormLayer holds when stage 3 ran on its
// own rows). backward_weight_together gives the same bits either way, and refuses a batch that mixes the two.
TEST(GatedMlpBlock, RecordsHoldingTheirRowsSourcesGiveTheRowsBitsAndDoNotMix) {
  Stream& s = Stream::cpu();
  const int64_t experts = 4, top_k = 2;
  const GatedMlpOptions o = gpt_oss_bank_options(experts);
  ParameterStore rows_store(with_whole_pieces(GatedMlp::param_specs(o, "experts.", 0)));
  ParameterStore sources_store(with_whole_pieces(GatedMlp::param_specs(o, "experts.", 0)));
  fill_random(rows_store, 53, 0.3);
  fill_random(sources_store, 53, 0.3);
  const GatedMlp mlp_rows(o, rows_store, "experts."), mlp_sources(o, sources_store, "experts.");
  // One micro-batch's record, holding its rows or their sources.
  const auto held_record = [&](const GatedMlp& mlp, MlpRecord& record, int64_t tokens, uint64_t seed, bool sources) {
    Rng draw(seed);
    std::vector<int32_t> choices(static_cast<size_t>(tokens * top_k));
    for (int32_t& e : choices) e = static_cast<int32_t>(draw.below(experts));
    const ops::RoutingPlan plan = ops::make_routing_plan(s, Tensor::from_vector(choices, {tokens, top_k}), experts);
    const Tensor normed = random_tensor({tokens, kHidden}, DType::F32, draw);
    const Tensor d_out = random_tensor({tokens, kHidden}, DType::F32, draw);
    const Tensor weight = random_tensor({tokens, top_k}, DType::F32, draw);
    const Tensor x = Tensor::empty({tokens * top_k, kHidden}, DType::F32);
    ops::permute_forward(s, x, normed, plan);
    const Tensor d_y = Tensor::empty({tokens * top_k, kHidden}, DType::F32);
    const Tensor d_weight = Tensor::empty({tokens, top_k}, DType::F32);
    ops::unpermute_backward(s, d_y, d_weight, d_out, x, weight, plan);
    mlp.forward(record, x, plan.expert_offsets);
    mlp.backward_input(record, d_y);
    GatedMlp::keep_for_weight_work(record);
    if (!sources) return;
    record.x_source = ops::PermutedRows{normed, Tensor(), plan};
    record.d_y_source = ops::PermutedRows{d_out, weight, plan};
    record.x = record.d_y = Tensor();
  };
  for (ParameterStore* store : {&rows_store, &sources_store}) store->begin_accumulation();
  std::vector<MlpRecord> a(3), b(3);
  for (size_t i = 0; i < 3; ++i) {
    const int64_t tokens = 3 + 4 * static_cast<int64_t>(i);
    held_record(mlp_rows, a[i], tokens, 60 + i, false);
    held_record(mlp_sources, b[i], tokens, 60 + i, true);
  }
  mlp_rows.backward_weight_together({&a[0], &a[1], &a[2]});
  mlp_sources.backward_weight_together({&b[0], &b[1], &b[2]});
  for (ParameterStore* store : {&rows_store, &sources_store}) store->end_accumulation();
  for (const MlpRecord& r : b) EXPECT_FALSE(r.x_source.tokens.defined() || r.d_y_source.tokens.defined());
  for (const ParamSpec& spec : rows_store.specs()) {
    EXPECT_EQ(values(sources_store.grad(spec.name)), values(rows_store.grad(spec.name))) << spec.name;
  }

  std::vector<MlpRecord> mixed(2);
  held_record(mlp_rows, mixed[0], 5, 70, false);
  held_record(mlp_rows, mixed[1], 6, 71, true);
  const std::string m = error_message([&] { mlp_rows.backward_weight_together({&mixed[0], &mixed[1]}); });
  EXPECT_TRUE(contains(m,
                       "the held records of one weight gradient must all hold their rows, or all their rows' "
                       "sources"))
      << m;
}

// transformers' GptOssExperts written out in f64 for one expert: gate_up = x W + b (gate rows first here), gate
// clamped above at the limit, up to [-limit, limit], y = ((up + 1) * gate * sigmoid(alpha * gate)) Wd + bd. 1e-5
// relative is f32 rounding with margin; a clamp on the wrong side or a missing "+ 1" changes y by O(1).
TEST(GatedMlpBlock, ClampedBankOutputIsTheGptOssFormula) {
  const GatedMlpOptions o = gpt_oss_bank_options(1);
  ParameterStore store(with_whole_pieces(GatedMlp::param_specs(o, "experts.", 0)));
  fill_random(store, 43, 0.4);
  Rng rng(44);
  const int64_t rows = 6;
  const Tensor x = random_tensor({rows, kHidden}, DType::F32, rng);
  const GatedMlp mlp(o, store, "experts.");
  MlpRecord record;
  const Tensor y = mlp.forward(record, x, Tensor::from_vector<int32_t>({0, static_cast<int32_t>(rows)}, {2}));
  const std::vector<float> xs = values(x), wgu = values(store.param("experts.gate_up")),
                           bgu = values(store.param("experts.gate_up_bias")), wd = values(store.param("experts.down")),
                           bd = values(store.param("experts.down_bias"));
  const double limit = o.swiglu_limit, alpha = o.swiglu_alpha;
  std::vector<double> expected(static_cast<size_t>(rows * kHidden), 0.0);
  int clamped = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> act(static_cast<size_t>(kWidth));
    for (int64_t i = 0; i < kWidth; ++i) {
      double gate = bgu[static_cast<size_t>(i)], up = bgu[static_cast<size_t>(kWidth + i)];
      for (int64_t h = 0; h < kHidden; ++h) {
        gate += double(wgu[static_cast<size_t>(i * kHidden + h)]) * xs[static_cast<size_t>(r * kHidden + h)];
        up += double(wgu[static_cast<size_t>((kWidth + i) * kHidden + h)]) * xs[static_cast<size_t>(r * kHidden + h)];
      }
      clamped += (gate > limit) + (std::abs(up) > limit);
      gate = std::min(gate, limit);
      up = std::clamp(up, -limit, limit);
      act[static_cast<size_t>(i)] = (up + 1.0) * gate / (1.0 + std::exp(-alpha * gate));
    }
    for (int64_t h = 0; h < kHidden; ++h) {
      double sum = bd[static_cast<size_t>(h)];
      for (int64_t i = 0; i < kWidth; ++i)
        sum += double(wd[static_cast<size_t>(h * kWidth + i)]) * act[static_cast<size_t>(i)];
      expected[static_cast<size_t>(r * kHidden + h)] = sum;
    }
  }
  EXPECT_GT(clamped, 0) << "the inputs should cross the clamps";
  EXPECT_LT(testing::relative_error(y, Tensor::from_vector(expected, {rows, kHidden})), 1e-5);
}

// Builds the MLP on a store holding its parameters, so that only the refusal can make construction fail.
std::string refusal(const GatedMlpOptions& o) {
  ParameterStore store(with_whole_pieces(GatedMlp::param_specs(o, "mlp.", 0)));
  return error_message([&] { GatedMlp mlp(o, store, "mlp."); });
}

TEST(GatedMlpBlockOptions, RefusesAClampedSwigluWithABadLimit) {
  GatedMlpOptions o = dense_options();
  o.activation = GatedActivation::ClampedSwiGlu;
  o.swiglu_limit = -1.0f;
  const std::string m = refusal(o);
  EXPECT_TRUE(contains(m, "gated MLP") && contains(m, "limit")) << m;
}

TEST(GatedMlpBlockOptions, RefusesARoleThatDoesNotMatchDenseOrBank) {
  GatedMlpOptions o = bank_options(4);
  o.role = ParamRole::Dense;
  std::string m = refusal(o);
  EXPECT_TRUE(contains(m, "4 experts with role 'dense'")) << m;
  o = dense_options();
  o.role = ParamRole::ExpertBank;
  m = refusal(o);
  EXPECT_TRUE(contains(m, "0 experts with role 'expert bank'")) << m;
  o.role = ParamRole::SharedExpert;  // a dense MLP may be a shared expert
  ParameterStore store(with_whole_pieces(GatedMlp::param_specs(o, "mlp.", 0)));
  EXPECT_NO_THROW(GatedMlp(o, store, "mlp."));
}

}  // namespace
}  // namespace moetrain::model
