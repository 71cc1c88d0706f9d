// Tests for the CUDA router kernels (ops/cuda/router.*) through the public ops: forward against the CPU reference
// (exact top-k indices on well-separated logits, ties to the lower expert index, with and without renormalisation,
// expert counts that are and are not multiples of 32), backward against the CPU on identical inputs, bitwise
// determinism, and the CUDA argument checks.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
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

struct Shape3 {
  int64_t tokens, experts, top_k;
};

const Shape3 kShapes[] = {{1000, 8, 2}, {1000, 64, 6}, {777, 160, 8}, {3, 32, 1}, {1, 5, 5}};

TEST(CudaRouter, ForwardMatchesCpuWithExactIndices) {
  MT_REQUIRE_GPU();
  // probs / weights: f32 softmax over at most 160 experts; expf and the sum order differ from the CPU's by a few
  // ulp, so 1e-6 relative.
  constexpr double kThreshold = 1e-6;
  Rng rng(11);
  for (const Shape3& s : kShapes) {
    for (const bool renormalize : {false, true}) {
      const ops::RouterParams params{static_cast<int>(s.top_k), renormalize};
      const Tensor logits = separated_logits(s.tokens, s.experts, rng);
      const Routed g = route(logits, params, gpu());
      const Routed c = route(logits, params, Device::cpu());
      const std::string what = "T=" + std::to_string(s.tokens) + " E=" + std::to_string(s.experts) +
                               " K=" + std::to_string(s.top_k) + (renormalize ? " renormalized" : "");
      EXPECT_EQ(g.topk_index.to_vector<int32_t>(), c.topk_index.to_vector<int32_t>()) << what << ": topk_index";
      const double probs_err = relative_error(g.probs, c.probs);
      const double weight_err = relative_error(g.topk_weight, c.topk_weight);
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

TEST(CudaRouter, BackwardMatchesCpuOnTheSameInputs) {
  MT_REQUIRE_GPU();
  // Both backends get the CPU forward's probs / selection: the differences are rounding in sums over at most 160
  // experts (fused multiply-adds and a warp tree on the GPU), ~1e-7 relative.
  constexpr double kThreshold = 1e-6;
  Rng rng(12);
  for (const Shape3& s : kShapes) {
    for (const bool renormalize : {false, true}) {
      for (const bool with_dprobs : {false, true}) {
        const ops::RouterParams params{static_cast<int>(s.top_k), renormalize};
        const Routed r = route(separated_logits(s.tokens, s.experts, rng), params, Device::cpu());
        const Tensor dw = random_tensor({s.tokens, s.top_k}, DType::F32, rng);
        const Tensor dprobs = with_dprobs ? random_tensor({s.tokens, s.experts}, DType::F32, rng) : Tensor();
        const Tensor g = route_backward(r, dw, dprobs, params, gpu());
        const Tensor c = route_backward(r, dw, dprobs, params, Device::cpu());
        const double err = relative_error(g, c);
        EXPECT_LT(err, kThreshold) << "T=" << s.tokens << " E=" << s.experts << " K=" << s.top_k
                                   << (renormalize ? " renormalized" : "") << (with_dprobs ? " with dprobs" : "")
                                   << ": dlogits relative error " << err;
      }
    }
  }
}

TEST(CudaRouter, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  Rng rng(13);
  const ops::RouterParams params{6, true};
  const Tensor logits = random_tensor({999, 64}, DType::F32, rng);
  const Routed a = route(logits, params, gpu()), b = route(logits, params, gpu());
  EXPECT_TRUE(same_bytes(a.probs, b.probs)) << "probs";
  EXPECT_TRUE(same_bytes(a.topk_index, b.topk_index)) << "topk_index";
  EXPECT_TRUE(same_bytes(a.topk_weight, b.topk_weight)) << "topk_weight";
  const Tensor dw = random_tensor({999, 6}, DType::F32, rng), dprobs = random_tensor({999, 64}, DType::F32, rng);
  EXPECT_TRUE(same_bytes(route_backward(a, dw, dprobs, params, gpu()), route_backward(a, dw, dprobs, params, gpu())))
      << "dlogits";
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
}

}  // namespace
}  // namespace moetrain
