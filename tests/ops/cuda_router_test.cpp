// Tests for the CUDA router kernels (ops/cuda/router.*) through the public ops: forward against the CPU reference
// (exact top-k indices on well-separated logits, ties to the lower expert index and to the lower group index, with
// and without renormalisation, greedy and group-limited with a scaling factor, E = 8 to 256 with top-1 to top-8,
// expert counts that are and are not multiples of 32, more groups than lanes), the greedy path unchanged by
// neutral group and scaling options, the masked-expert corner, backward against the CPU on identical inputs,
// bitwise determinism, the CUDA argument checks, and GPT-OSS's top-k over the logits with a softmax over the k kept
// (exact indices on any logits, ties, logits that round to equal probabilities, backward with and without dprobs).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "ops/router.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::random_tensor;
using testing::relative_error;

Device gpu() { return Device::cuda(0); }

// Logits whose experts are at least 0.25 apart within each token (a shuffled ladder plus small noise): the
// probabilities differ by far more than the GPU's and the CPU's rounding, so the selection is unambiguous.
Tensor separated_logits(int64_t tokens, int64_t experts, Rng& rng) {
  std::vector<float> values(static_cast<size_t>(tokens * experts));
  std::vector<int64_t> order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = experts - 1; i > 0; --i) {
      std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(rng.below(static_cast<uint64_t>(i + 1)))]);
    }
    for (int64_t e = 0; e < experts; ++e) {
      values[static_cast<size_t>(t * experts + e)] =
          static_cast<float>(0.25 * static_cast<double>(order[static_cast<size_t>(e)]) - 4.0 + 0.05 * rng.uniform());
    }
  }
  return Tensor::from_vector<float>(values, {tokens, experts});
}

struct Routed {
  Tensor probs, topk_index, topk_weight;  // on the CPU
};

Routed route(const Tensor& logits, const ops::RouterParams& params, Device device) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  Tensor probs = Tensor::empty({tokens, experts}, DType::F32, device);
  Tensor index = Tensor::empty({tokens, params.top_k}, DType::I32, device);
  Tensor weight = Tensor::empty({tokens, params.top_k}, DType::F32, device);
  ops::router_forward(default_stream(device), probs, index, weight, logits.to(device), params);
  return {probs.to(Device::cpu()), index.to(Device::cpu()), weight.to(Device::cpu())};
}

Tensor route_backward(const Routed& r, const Tensor& dtopk_weight, const Tensor& dprobs,
                      const ops::RouterParams& params, Device device) {
  Tensor dlogits = Tensor::empty(r.probs.shape(), DType::F32, device);
  ops::router_backward(default_stream(device), dlogits, dtopk_weight.to(device),
                       dprobs.defined() ? dprobs.to(device) : Tensor(), r.probs.to(device), r.topk_index.to(device),
                       r.topk_weight.to(device), params);
  return dlogits.to(Device::cpu());
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

struct Case {
  int64_t tokens, experts;
  ops::RouterParams params;  // renormalize is varied by the tests
};

std::string describe(const Case& c, bool renormalize) {
  const ops::RouterParams& p = c.params;
  return "T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.experts) + " K=" + std::to_string(p.top_k) +
         " groups " + std::to_string(p.topk_groups) + "/" + std::to_string(p.num_groups) + " scale " +
         std::to_string(p.scaling_factor) + (renormalize ? " renormalized" : "");
}

ops::RouterParams with_renormalize(ops::RouterParams p, bool renormalize) {
  p.renormalize = renormalize;
  return p;
}

const Case kCases[] = {
    // greedy
    {1000, 8, {2}},
    {1000, 64, {6}},
    {777, 160, {8}},
    {3, 32, {1}},
    {1, 5, {5}},
    {500, 128, {8, false, 1, 1, 2.5}},
    // group-limited, with and without a scaling factor (DeepSeek-V2: E = 160, 8 groups, 3 kept, top-6, 16)
    {1000, 16, {3, false, 4, 2, 16.0}},
    {1000, 64, {6, false, 8, 3, 1.0}},
    {777, 160, {6, false, 8, 3, 16.0}},
    {500, 128, {8, false, 8, 4, 2.5}},
    {500, 256, {8, false, 8, 4, 2.5}},
    {300, 128, {8, false, 64, 5, 1.0}},  // more groups than lanes, two experts each
    {300, 96, {4, false, 96, 7, 0.5}},   // one expert per group
    {7, 12, {8, false, 3, 2, 16.0}},     // top-k filling the kept groups
};

TEST(CudaRouter, ForwardMatchesCpuWithExactIndices) {
  MT_REQUIRE_GPU();
  // probs / weights: f32 softmax over at most 256 experts; expf and the sum order differ from the CPU's by a few
  // ulp, so 1e-6 relative.
  constexpr double kThreshold = 1e-6;
  Rng rng(11);
  for (const Case& c : kCases) {
    for (const bool renormalize : {false, true}) {
      const ops::RouterParams params = with_renormalize(c.params, renormalize);
      const Tensor logits = separated_logits(c.tokens, c.experts, rng);
      const Routed g = route(logits, params, gpu());
      const Routed cpu = route(logits, params, Device::cpu());
      const std::string what = describe(c, renormalize);
      EXPECT_EQ(g.topk_index.to_vector<int32_t>(), cpu.topk_index.to_vector<int32_t>()) << what << ": topk_index";
      const double probs_err = relative_error(g.probs, cpu.probs);
      const double weight_err = relative_error(g.topk_weight, cpu.topk_weight);
      EXPECT_LT(probs_err, kThreshold) << what << ": probs relative error " << probs_err;
      EXPECT_LT(weight_err, kThreshold) << what << ": topk_weight relative error " << weight_err;
    }
  }
}

TEST(CudaRouter, EqualProbabilitiesPickTheLowerExpertFirst) {
  MT_REQUIRE_GPU();
  // Equal logits give bitwise equal probabilities, so the tie rule decides: lower expert index first.
  const Tensor logits = Tensor::from_vector<float>({1, 3, 3, 0, 3, /**/ 0, 0, 0, 0, 0, /**/ 2, 1, 2, 1, 2}, {3, 5});
  const ops::RouterParams params{3, false};
  const Routed g = route(logits, params, gpu());
  EXPECT_EQ(g.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 4, 0, 1, 2, 0, 2, 4}));
  EXPECT_EQ(g.topk_index.to_vector<int32_t>(), route(logits, params, Device::cpu()).topk_index.to_vector<int32_t>());
}

TEST(CudaRouter, EqualGroupScoresPickTheLowerGroupFirst) {
  MT_REQUIRE_GPU();
  // Three groups of two (tests/ops/router_test.cpp's hand case): token 0 ties all three groups, token 1 is all
  // equal, token 2 ties groups 1 and 2 above group 0.
  const Tensor logits =
      Tensor::from_vector<float>({1, 3, 3, 0, 2, 3, /**/ 0, 0, 0, 0, 0, 0, /**/ 0, 1, 2, 0, 2, 1}, {3, 6});
  const ops::RouterParams one{2, false, 3, 1, 1.0}, two{3, false, 3, 2, 1.0};
  EXPECT_EQ(route(logits, one, gpu()).topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 0, 0, 1, 2, 3}));
  EXPECT_EQ(route(logits, two, gpu()).topk_index.to_vector<int32_t>(),
            (std::vector<int32_t>{1, 2, 0, 0, 1, 2, 2, 4, 5}));
  // 40 groups of one expert, all equal: more groups than lanes, the kept ones are the lowest.
  const Tensor flat = Tensor::zeros({1, 40}, DType::F32);
  EXPECT_EQ(route(flat, {3, false, 40, 35, 1.0}, gpu()).topk_index.to_vector<int32_t>(),
            (std::vector<int32_t>{0, 1, 2}));
}

// Neutral options (every group kept, a factor of 1) leave the greedy kernels' bytes as they are, and a power-of-two
// factor scales the weights exactly.
TEST(CudaRouter, NeutralGroupAndScalingOptionsAreTheGreedyBytes) {
  MT_REQUIRE_GPU();
  Rng rng(15);
  const Tensor logits = random_tensor({999, 64}, DType::F32, rng, 2.0);
  const Tensor dw = random_tensor({999, 6}, DType::F32, rng), dprobs = random_tensor({999, 64}, DType::F32, rng);
  for (const bool renormalize : {false, true}) {
    const ops::RouterParams greedy{6, renormalize};
    const Routed a = route(logits, greedy, gpu());
    const Tensor da = route_backward(a, dw, dprobs, greedy, gpu());
    for (const ops::RouterParams& neutral :
         {ops::RouterParams{6, renormalize, 8, 8, 1.0}, ops::RouterParams{6, renormalize, 64, 64, 1.0}}) {
      const Routed b = route(logits, neutral, gpu());
      EXPECT_TRUE(same_bytes(a.probs, b.probs));
      EXPECT_TRUE(same_bytes(a.topk_index, b.topk_index));
      EXPECT_TRUE(same_bytes(a.topk_weight, b.topk_weight));
      EXPECT_TRUE(same_bytes(da, route_backward(b, dw, dprobs, neutral, gpu())));
    }
    const Routed scaled = route(logits, {6, renormalize, 1, 1, 16.0}, gpu());
    std::vector<float> expected = a.topk_weight.to_vector<float>();
    for (float& w : expected) w *= 16.0f;
    EXPECT_EQ(scaled.topk_weight.to_vector<float>(), expected);
    EXPECT_TRUE(same_bytes(a.topk_index, scaled.topk_index));
  }
}

// One kept group whose second expert underflows to 0: a masked expert wins the tie at 0 with weight 0 and no
// gradient, as on the CPU.
TEST(CudaRouter, MaskedExpertAtAZeroTieMatchesCpu) {
  MT_REQUIRE_GPU();
  const Tensor logits = Tensor::from_vector<float>({50, 50, 120, 0}, {1, 4});
  const ops::RouterParams params{2, false, 2, 1, 2.0};
  const Routed g = route(logits, params, gpu()), c = route(logits, params, Device::cpu());
  EXPECT_EQ(g.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(g.topk_weight.to_vector<float>()[1], 0.0f);
  EXPECT_LT(relative_error(g.topk_weight, c.topk_weight), 1e-6);
  const Tensor dw = Tensor::from_vector<float>({0.75f, -1.5f}, {1, 2});
  const Tensor dg = route_backward(c, dw, Tensor(), params, gpu()),
               dc = route_backward(c, dw, Tensor(), params, Device::cpu());
  EXPECT_LT(relative_error(dg, dc), 1e-6);
  EXPECT_NEAR(dg.to_vector<float>()[0], dc.to_vector<float>()[0], 1e-6 * std::abs(dc.to_vector<float>()[0]));
}

TEST(CudaRouter, BackwardMatchesCpuOnTheSameInputs) {
  MT_REQUIRE_GPU();
  // Both backends get the CPU forward's probs / selection: the differences are rounding in sums over at most 256
  // experts (fused multiply-adds and a warp tree on the GPU), ~1e-7 relative.
  constexpr double kThreshold = 1e-6;
  Rng rng(12);
  for (const Case& c : kCases) {
    for (const bool renormalize : {false, true}) {
      for (const bool with_dprobs : {false, true}) {
        const ops::RouterParams params = with_renormalize(c.params, renormalize);
        const Routed r = route(separated_logits(c.tokens, c.experts, rng), params, Device::cpu());
        const Tensor dw = random_tensor({c.tokens, params.top_k}, DType::F32, rng);
        const Tensor dprobs = with_dprobs ? random_tensor({c.tokens, c.experts}, DType::F32, rng) : Tensor();
        const Tensor g = route_backward(r, dw, dprobs, params, gpu());
        const Tensor cpu = route_backward(r, dw, dprobs, params, Device::cpu());
        const double err = relative_error(g, cpu);
        EXPECT_LT(err, kThreshold) << describe(c, renormalize) << (with_dprobs ? " with dprobs" : "")
                                   << ": dlogits relative error " << err;
      }
    }
  }
}

TEST(CudaRouter, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  Rng rng(13);
  for (const ops::RouterParams& params : {ops::RouterParams{6, true}, ops::RouterParams{6, true, 8, 3, 16.0}}) {
    const Tensor logits = random_tensor({999, 64}, DType::F32, rng);
    const Routed a = route(logits, params, gpu()), b = route(logits, params, gpu());
    EXPECT_TRUE(same_bytes(a.probs, b.probs)) << "probs";
    EXPECT_TRUE(same_bytes(a.topk_index, b.topk_index)) << "topk_index";
    EXPECT_TRUE(same_bytes(a.topk_weight, b.topk_weight)) << "topk_weight";
    const Tensor dw = random_tensor({999, 6}, DType::F32, rng), dprobs = random_tensor({999, 64}, DType::F32, rng);
    EXPECT_TRUE(same_bytes(route_backward(a, dw, dprobs, params, gpu()), route_backward(a, dw, dprobs, params, gpu())))
        << "dlogits";
  }
}

TEST(CudaRouter, RejectsNonF32AndMixedDevices) {
  MT_REQUIRE_GPU();
  Rng rng(14);
  const ops::RouterParams params{2, false};
  Stream& s = default_stream(gpu());
  Tensor probs = Tensor::empty({4, 8}, DType::F32, gpu());
  Tensor index = Tensor::empty({4, 2}, DType::I32, gpu());
  Tensor weight = Tensor::empty({4, 2}, DType::F32, gpu());
  const Tensor logits = random_tensor({4, 8}, DType::F32, rng);
  expect_error([&] { ops::router_forward(s, probs, index, weight, logits.to(DType::BF16).to(gpu()), params); },
               "expected logits in f32 on CUDA");
  expect_error([&] { ops::router_forward(Stream::cpu(), probs, index, weight, logits.to(gpu()), params); },
               "logits is on cuda:0 but the stream runs on cpu");
  Tensor index_cpu = Tensor::empty({4, 2}, DType::I32);
  expect_error([&] { ops::router_forward(s, probs, index_cpu, weight, logits.to(gpu()), params); },
               "expected topk_index on cuda:0");
  // The group scores live in shared memory: at most 1024 groups on CUDA (the CPU takes any).
  const Tensor wide = random_tensor({2, 2048}, DType::F32, rng);
  const ops::RouterParams many{1, false, 2048, 1, 1.0};
  Tensor wide_probs = Tensor::empty({2, 2048}, DType::F32, gpu());
  Tensor one_index = Tensor::empty({2, 1}, DType::I32, gpu()), one_weight = Tensor::empty({2, 1}, DType::F32, gpu());
  expect_error([&] { ops::router_forward(s, wide_probs, one_index, one_weight, wide.to(gpu()), many); },
               "router_forward: num_groups (2048) exceeds the CUDA kernel's 1024");
  expect_error(
      [&] {
        ops::router_forward(s, probs, index, weight, logits.to(gpu()), {2, false, 3, 1, 1.0});
      },
      "router_forward: E = 8 is not divisible by num_groups (3)");
}

ops::RouterParams topk_then_softmax(int top_k) {
  ops::RouterParams p{top_k};
  p.topk_before_softmax = true;
  return p;
}

// Logits from N(0, 2^2), or (coarse) rounded to multiples of 0.5 so that many tie.
Tensor gpt_oss_logits(int64_t tokens, int64_t experts, bool coarse, Rng& rng) {
  Tensor t = random_tensor({tokens, experts}, DType::F32, rng, 2.0);
  if (coarse) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = std::round(p[i] * 2.0f) / 2.0f;
  }
  return t;
}

struct TopkCase {
  int64_t tokens, experts;
  int top_k;
};

// GPT-OSS: 32 experts top-4 (20b), 128 top-4 (120b); others for the lane layout and k.
const TopkCase kTopkCases[] = {{1000, 32, 4}, {777, 128, 4}, {500, 8, 1}, {300, 160, 8}, {3, 5, 5}, {64, 33, 2}};

TEST(CudaRouter, TopkBeforeSoftmaxMatchesCpuWithExactIndices) {
  MT_REQUIRE_GPU();
  // The selection ranks the logits themselves, identical inputs on both backends: the indices agree exactly on any
  // logits, ties included. probs / weights: f32 softmaxes over at most 160 terms, expf and the sum order differing
  // from the CPU's by a few ulp: 1e-6 relative.
  constexpr double kThreshold = 1e-6;
  Rng rng(16);
  for (const TopkCase& c : kTopkCases) {
    for (const bool coarse : {false, true}) {
      const std::string what = "T=" + std::to_string(c.tokens) + " E=" + std::to_string(c.experts) +
                               " K=" + std::to_string(c.top_k) + (coarse ? " with ties" : "");
      const ops::RouterParams params = topk_then_softmax(c.top_k);
      const Tensor logits = gpt_oss_logits(c.tokens, c.experts, coarse, rng);
      const Routed g = route(logits, params, gpu());
      const Routed cpu = route(logits, params, Device::cpu());
      EXPECT_EQ(g.topk_index.to_vector<int32_t>(), cpu.topk_index.to_vector<int32_t>()) << what << ": topk_index";
      const double probs_err = relative_error(g.probs, cpu.probs);
      const double weight_err = relative_error(g.topk_weight, cpu.topk_weight);
      EXPECT_LT(probs_err, kThreshold) << what << ": probs relative error " << probs_err;
      EXPECT_LT(weight_err, kThreshold) << what << ": topk_weight relative error " << weight_err;
    }
  }
}

TEST(CudaRouter, TopkBeforeSoftmaxTiesAndUnderflowedProbabilities) {
  MT_REQUIRE_GPU();
  // Equal logits pick the lower expert first (tests/ops/router_test.cpp's hand case).
  const Tensor ties = Tensor::from_vector<float>({1, 3, 3, 0, /**/ 2, 0, 2, 2, /**/ 0, 0, 0, 0}, {3, 4});
  const Routed g = route(ties, topk_then_softmax(3), gpu());
  EXPECT_EQ(g.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 0, 0, 2, 3, 0, 1, 2}));
  EXPECT_LT(relative_error(g.topk_weight, route(ties, topk_then_softmax(3), Device::cpu()).topk_weight), 1e-6);
  // 1000 and the next f32 above both have probability 0 beside 2000: the logits decide, expert 1 before expert 0.
  const Tensor under = Tensor::from_vector<float>({1000.0f, std::nextafter(1000.0f, 2000.0f), 2000.0f}, {1, 3});
  const Routed u = route(under, topk_then_softmax(2), gpu());
  EXPECT_EQ(u.topk_index.to_vector<int32_t>(), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(u.topk_weight.to_vector<float>(), (std::vector<float>{1.0f, 0.0f}));
}

TEST(CudaRouter, TopkBeforeSoftmaxBackwardMatchesCpuOnTheSameInputs) {
  MT_REQUIRE_GPU();
  // Both backends get the CPU forward's outputs: the differences are the rounding of sums over at most 160 experts
  // and 8 slots (a warp tree and fused multiply-adds on the GPU), ~1e-7 relative.
  constexpr double kThreshold = 1e-6;
  Rng rng(17);
  for (const TopkCase& c : kTopkCases) {
    for (const bool with_dprobs : {false, true}) {
      const ops::RouterParams params = topk_then_softmax(c.top_k);
      const Routed r = route(gpt_oss_logits(c.tokens, c.experts, false, rng), params, Device::cpu());
      const Tensor dw = random_tensor({c.tokens, params.top_k}, DType::F32, rng);
      const Tensor dprobs = with_dprobs ? random_tensor({c.tokens, c.experts}, DType::F32, rng) : Tensor();
      const Tensor g = route_backward(r, dw, dprobs, params, gpu());
      const Tensor cpu = route_backward(r, dw, dprobs, params, Device::cpu());
      const double err = relative_error(g, cpu);
      EXPECT_LT(err, kThreshold) << "E=" << c.experts << " K=" << c.top_k << (with_dprobs ? " with dprobs" : "")
                                 << ": dlogits relative error " << err;
      if (!with_dprobs) {
        // Only the selected logits receive a gradient, on both backends.
        const std::vector<float> gv = g.to_vector<float>(), cv = cpu.to_vector<float>();
        for (size_t i = 0; i < gv.size(); ++i) {
          if (cv[i] == 0.0f) {
            EXPECT_EQ(gv[i], 0.0f) << "element " << i;
          }
        }
      }
    }
  }
}

TEST(CudaRouter, TopkBeforeSoftmaxRepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  Rng rng(18);
  const ops::RouterParams params = topk_then_softmax(4);
  const Tensor logits = gpt_oss_logits(999, 128, true, rng);
  const Routed a = route(logits, params, gpu()), b = route(logits, params, gpu());
  EXPECT_TRUE(same_bytes(a.probs, b.probs)) << "probs";
  EXPECT_TRUE(same_bytes(a.topk_index, b.topk_index)) << "topk_index";
  EXPECT_TRUE(same_bytes(a.topk_weight, b.topk_weight)) << "topk_weight";
  const Tensor dw = random_tensor({999, 4}, DType::F32, rng), dprobs = random_tensor({999, 128}, DType::F32, rng);
  EXPECT_TRUE(same_bytes(route_backward(a, dw, dprobs, params, gpu()), route_backward(a, dw, dprobs, params, gpu())))
      << "dlogits";
}

TEST(CudaRouter, TopkBeforeSoftmaxRefusesRenormalizeOnCuda) {
  MT_REQUIRE_GPU();
  Rng rng(19);
  ops::RouterParams params = topk_then_softmax(2);
  params.renormalize = true;
  Tensor probs = Tensor::empty({4, 8}, DType::F32, gpu());
  Tensor index = Tensor::empty({4, 2}, DType::I32, gpu());
  Tensor weight = Tensor::empty({4, 2}, DType::F32, gpu());
  expect_error(
      [&] {
        ops::router_forward(default_stream(gpu()), probs, index, weight,
                            random_tensor({4, 8}, DType::F32, rng).to(gpu()), params);
      },
      "router_forward: topk_before_softmax takes no renormalize");
}

// A random selection of k distinct experts per token (a shuffled prefix), not the top-k.
Tensor random_selection(int64_t tokens, int64_t experts, int k, Rng& rng) {
  std::vector<int32_t> index;
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = experts - 1; i > 0; --i) {
      std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(rng.below(static_cast<uint64_t>(i + 1)))]);
    }
    index.insert(index.end(), order.begin(), order.begin() + k);
  }
  return Tensor::from_vector<int32_t>(index, {tokens, k});
}

Routed route_given(const Tensor& logits, const Tensor& selection, const ops::RouterParams& params, Device device) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  Tensor probs = Tensor::empty({tokens, experts}, DType::F32, device);
  Tensor index = selection.to(device);
  Tensor weight = Tensor::empty({tokens, params.top_k}, DType::F32, device);
  ops::router_forward_given(default_stream(device), probs, index, weight, logits.to(device), params);
  return {probs.to(Device::cpu()), index.to(Device::cpu()), weight.to(Device::cpu())};
}

TEST(CudaRouter, GivenSelectionMatchesCpu) {
  MT_REQUIRE_GPU();
  // The selection is an input, the same on both backends: probs / weights differ by expf and the sum order, a few
  // ulp (1e-6 relative, as above). A given selection equal to the op's own gives the op's own bytes.
  constexpr double kThreshold = 1e-6;
  Rng rng(90);
  std::vector<std::pair<std::string, ops::RouterParams>> cases;
  for (const Case& c : kCases) {
    if (c.experts == 64) cases.emplace_back(describe(c, true), with_renormalize(c.params, true));
  }
  cases.emplace_back("top-4 before softmax", topk_then_softmax(4));
  cases.emplace_back("top-2 of 4 groups, 2 kept", ops::RouterParams{2, false, 4, 2, 1.0});
  for (const auto& [what, params] : cases) {
    const Tensor logits = gpt_oss_logits(300, 64, false, rng);
    const Tensor selection = random_selection(300, 64, params.top_k, rng);
    // A selection made elsewhere is weighed without the group mask (a renormalised one wholly outside the kept
    // groups would weigh 0 / 0 under it), as the router block weighs a pinned selection.
    ops::RouterParams unmasked = params;
    unmasked.num_groups = unmasked.topk_groups = 1;
    const Routed g = route_given(logits, selection, unmasked, gpu());
    const Routed cpu = route_given(logits, selection, unmasked, Device::cpu());
    EXPECT_EQ(g.topk_index.to_vector<int32_t>(), selection.to_vector<int32_t>()) << what;
    EXPECT_LT(relative_error(g.probs, cpu.probs), kThreshold) << what;
    EXPECT_LT(relative_error(g.topk_weight, cpu.topk_weight), kThreshold) << what;
    const Routed own = route(logits, params, gpu());
    const Routed own_given = route_given(logits, own.topk_index, params, gpu());
    EXPECT_TRUE(same_bytes(own_given.topk_weight, own.topk_weight)) << what;
    EXPECT_TRUE(same_bytes(own_given.probs, own.probs)) << what;
  }
}

}  // namespace
}  // namespace moetrain
