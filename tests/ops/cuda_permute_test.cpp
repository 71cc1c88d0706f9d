// Tests for the CUDA permutation kernels (ops/cuda/permute.*) through the public ops: the device routing plan
// equals the CPU plan exactly (idle experts, one expert, no tokens, large T*K); permute / unpermute forward and
// backward against the CPU in f32 (bitwise where the sums are in slot order) and bf16; bitwise determinism; the
// CUDA argument checks; and concat_permuted_rows against the CUDA ops it fuses (bitwise) and against the CPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/elementwise.h"
#include "ops/permute.h"
#include "ops/row_gather.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::random_tensor;
using testing::relative_error;

Device gpu() { return Device::cuda(0); }

// Choices drawn uniformly from the experts not in `idle`.
Tensor random_choices(int64_t tokens, int64_t top_k, int64_t experts, Rng& rng, const std::vector<int32_t>& idle = {}) {
  std::vector<int32_t> active;
  for (int32_t e = 0; e < experts; ++e) {
    if (std::find(idle.begin(), idle.end(), e) == idle.end()) active.push_back(e);
  }
  std::vector<int32_t> index(static_cast<size_t>(tokens * top_k));
  for (int32_t& e : index) e = active[static_cast<size_t>(rng.below(active.size()))];
  return Tensor::from_vector<int32_t>(index, {tokens, top_k});
}

// Element-wise bitwise equality, reporting how many elements differ and the first one (not the whole vectors).
template <typename T>
void expect_same_values(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << got.size() << " elements differ, the first at ["
                            << first << "]: gpu " << (mismatches ? got[first] : T{}) << " vs cpu "
                            << (mismatches ? want[first] : T{});
}

ops::RoutingPlan plan_on(const Tensor& topk_index, int64_t experts, Device device) {
  return ops::make_routing_plan(default_stream(device), topk_index.to(device), experts);
}

ops::RoutingPlan plan_to_cpu(const ops::RoutingPlan& plan) {
  ops::RoutingPlan host = plan;
  host.expert_offsets = plan.expert_offsets.to(Device::cpu());
  host.row_choice = plan.row_choice.to(Device::cpu());
  host.choice_row = plan.choice_row.to(Device::cpu());
  return host;
}

void expect_same_plan(const ops::RoutingPlan& gpu_plan, const ops::RoutingPlan& cpu_plan, const std::string& what) {
  const ops::RoutingPlan g = plan_to_cpu(gpu_plan);
  EXPECT_EQ(g.num_tokens, cpu_plan.num_tokens) << what;
  EXPECT_EQ(g.top_k, cpu_plan.top_k) << what;
  EXPECT_EQ(g.num_experts, cpu_plan.num_experts) << what;
  expect_same_values(g.expert_offsets.to_vector<int32_t>(), cpu_plan.expert_offsets.to_vector<int32_t>(),
                     what + ": expert_offsets");
  expect_same_values(g.row_choice.to_vector<int32_t>(), cpu_plan.row_choice.to_vector<int32_t>(),
                     what + ": row_choice");
  expect_same_values(g.choice_row.to_vector<int32_t>(), cpu_plan.choice_row.to_vector<int32_t>(),
                     what + ": choice_row");
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.raw_data(), hb.raw_data(), ha.nbytes()) == 0;
}

TEST(CudaRoutingPlan, HandCaseMatchesTheCpuPlan) {
  MT_REQUIRE_GPU();
  // Choices (t, k) -> expert: (0,0) 2, (0,1) 0, (1,0) 2, (1,1) 3, (2,0) 0, (2,1) 2; expert 1 gets none.
  const Tensor index = Tensor::from_vector<int32_t>({2, 0, 2, 3, 0, 2}, {3, 2});
  const ops::RoutingPlan g = plan_to_cpu(plan_on(index, 4, gpu()));
  EXPECT_EQ(g.expert_offsets.to_vector<int32_t>(), (std::vector<int32_t>{0, 2, 2, 5, 6}));
  EXPECT_EQ(g.row_choice.to_vector<int32_t>(), (std::vector<int32_t>{1, 4, 0, 2, 5, 3}));
  EXPECT_EQ(g.choice_row.to_vector<int32_t>(), (std::vector<int32_t>{2, 0, 3, 5, 1, 4}));
}

TEST(CudaRoutingPlan, EqualsTheCpuPlanExactly) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t tokens, top_k, experts;
    std::vector<int32_t> idle;
  };
  const Case cases[] = {{1000, 4, 64, {}},        {1, 1, 1, {}},       {7, 3, 5, {2}}, {0, 2, 4, {}}, {513, 2, 3, {0}},
                        {4096, 6, 256, {7, 255}}, {20000, 8, 128, {}}, {300, 8, 8, {}}};
  Rng rng(21);
  for (const Case& c : cases) {
    const Tensor index = random_choices(c.tokens, c.top_k, c.experts, rng, c.idle);
    expect_same_plan(
        plan_on(index, c.experts, gpu()), plan_on(index, c.experts, Device::cpu()),
        "T=" + std::to_string(c.tokens) + " K=" + std::to_string(c.top_k) + " E=" + std::to_string(c.experts));
  }
}

struct Results {
  Tensor permuted, dx, y, dexpert_out, dtopk_weight;  // f32 on the CPU
};

struct Inputs {
  Tensor x, dpermuted, expert_out, weight, dy;  // f32 on the CPU
};

Inputs random_inputs(int64_t tokens, int64_t top_k, int64_t hidden, DType gpu_dtype, Rng& rng) {
  Inputs in{random_tensor({tokens, hidden}, DType::F32, rng), random_tensor({tokens * top_k, hidden}, DType::F32, rng),
            random_tensor({tokens * top_k, hidden}, DType::F32, rng), random_tensor({tokens, top_k}, DType::F32, rng),
            random_tensor({tokens, hidden}, DType::F32, rng)};
  if (gpu_dtype == DType::BF16) {
    for (Tensor* t : {&in.x, &in.dpermuted, &in.expert_out, &in.weight, &in.dy}) *t = t->to(DType::BF16).to(DType::F32);
  }
  return in;
}

// The four ops on `device` in `dtype` with the plan of `topk_index`; results back as f32 CPU tensors.
Results run_ops(const Inputs& in, const Tensor& topk_index, int64_t experts, Device device, DType dtype) {
  const ops::RoutingPlan plan = plan_on(topk_index, experts, device);
  const auto put = [&](const Tensor& t) { return t.to(dtype).to(device); };
  const int64_t tokens = in.x.size(0), hidden = in.x.size(1), rows = tokens * plan.top_k;
  Stream& s = default_stream(device);
  Tensor permuted = Tensor::empty({rows, hidden}, dtype, device);
  Tensor dx = Tensor::empty({tokens, hidden}, dtype, device);
  Tensor y = Tensor::empty({tokens, hidden}, dtype, device);
  Tensor dexpert_out = Tensor::empty({rows, hidden}, dtype, device);
  // The routing weights are f32 on CUDA whatever the activations (the router computes in f32).
  const DType weight_dtype = device.is_cuda() ? DType::F32 : dtype;
  Tensor dtopk_weight = Tensor::empty({tokens, plan.top_k}, weight_dtype, device);
  const Tensor expert_out = put(in.expert_out), weight = in.weight.to(weight_dtype).to(device);
  ops::permute_forward(s, permuted, put(in.x), plan);
  ops::permute_backward(s, dx, put(in.dpermuted), plan);
  ops::unpermute_forward(s, y, expert_out, weight, plan);
  ops::unpermute_backward(s, dexpert_out, dtopk_weight, put(in.dy), expert_out, weight, plan);
  const auto back = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::F32); };
  return {back(permuted), back(dx), back(y), back(dexpert_out), back(dtopk_weight)};
}

struct OpsCase {
  int64_t tokens, top_k, experts, hidden;
};
// H = 4104: rows of more 16-byte chunks than a warp's batch of 32 x 8 (a second, partial batch), 14 rows (a last
// block with idle warps). K = 36: a top-k wider than a warp, whose rows permute_forward's lanes find themselves.
const OpsCase kOpsCases[] = {{1000, 4, 64, 256}, {37, 2, 5, 300}, {1, 1, 1, 64},
                             {513, 8, 16, 1000}, {7, 2, 3, 4104}, {20, 36, 48, 256}};

std::string case_name(const OpsCase& c) {
  return "T=" + std::to_string(c.tokens) + " K=" + std::to_string(c.top_k) + " E=" + std::to_string(c.experts) +
         " H=" + std::to_string(c.hidden);
}

TEST(CudaPermute, F32MatchesCpu) {
  MT_REQUIRE_GPU();
  Rng rng(22);
  for (const OpsCase& c : kOpsCases) {
    const Tensor index = random_choices(c.tokens, c.top_k, c.experts, rng);
    const Inputs in = random_inputs(c.tokens, c.top_k, c.hidden, DType::F32, rng);
    const Results g = run_ops(in, index, c.experts, gpu(), DType::F32);
    const Results r = run_ops(in, index, c.experts, Device::cpu(), DType::F32);
    const std::string what = case_name(c);
    // Copies, and sums over the slots in ascending k with the products and sums rounded apart: the CPU's bits.
    expect_same_values(g.permuted.to_vector<float>(), r.permuted.to_vector<float>(), what + ": permuted");
    expect_same_values(g.dx.to_vector<float>(), r.dx.to_vector<float>(), what + ": dx");
    expect_same_values(g.y.to_vector<float>(), r.y.to_vector<float>(), what + ": y");
    expect_same_values(g.dexpert_out.to_vector<float>(), r.dexpert_out.to_vector<float>(), what + ": dexpert_out");
    // dtopk_weight is a dot product over H (up to 1000), summed in packs and a tree on the GPU, sequentially on the
    // CPU. Each side errs by at most (H + 1) u sum |dy_h e_h| (recursive summation of rounded products, u = 2^-24),
    // so they differ by at most twice that: a bound that holds for a dot with cancellation, where a relative error
    // of the result does not.
    const ops::RoutingPlan cpu_plan = plan_on(index, c.experts, Device::cpu());
    const std::vector<int32_t> choice_row = cpu_plan.choice_row.to_vector<int32_t>();
    const std::vector<float> dy = in.dy.to_vector<float>(), rows = in.expert_out.to_vector<float>();
    const std::vector<float> got = g.dtopk_weight.to_vector<float>(), want = r.dtopk_weight.to_vector<float>();
    int64_t over = 0;
    for (int64_t choice = 0; choice < c.tokens * c.top_k; ++choice) {
      const int64_t t = choice / c.top_k, row = choice_row[static_cast<size_t>(choice)];
      double magnitude = 0.0;
      for (int64_t h = 0; h < c.hidden; ++h) {
        magnitude += std::fabs(double(dy[static_cast<size_t>(t * c.hidden + h)]) *
                               double(rows[static_cast<size_t>(row * c.hidden + h)]));
      }
      const double bound = 2.0 * double(c.hidden + 1) * std::ldexp(1.0, -24) * magnitude;
      const double diff = std::fabs(double(got[static_cast<size_t>(choice)]) - want[static_cast<size_t>(choice)]);
      if (diff > bound && over++ == 0) {
        ADD_FAILURE() << what << ": dtopk_weight of choice " << choice << " differs by " << diff << ", over the bound "
                      << bound;
      }
    }
    EXPECT_EQ(over, 0) << what;
    std::printf("%s: dtopk_weight relative error %.2e\n", what.c_str(), relative_error(g.dtopk_weight, r.dtopk_weight));
  }
}

TEST(CudaPermute, Bf16MatchesCpuRoundedOnce) {
  MT_REQUIRE_GPU();
  Rng rng(23);
  for (const OpsCase& c : kOpsCases) {
    const Tensor index = random_choices(c.tokens, c.top_k, c.experts, rng);
    const Inputs in = random_inputs(c.tokens, c.top_k, c.hidden, DType::BF16, rng);
    const Results g = run_ops(in, index, c.experts, gpu(), DType::BF16);
    const Results r = run_ops(in, index, c.experts, Device::cpu(), DType::F32);
    const std::string what = case_name(c);
    // The GPU computes in f32 on the same (bf16) values in the CPU's order and rounds the result once to bf16.
    const auto rounded = [](const Tensor& t) { return t.to(DType::BF16).to(DType::F32).to_vector<float>(); };
    expect_same_values(g.permuted.to_vector<float>(), rounded(r.permuted), what + ": permuted");
    expect_same_values(g.dx.to_vector<float>(), rounded(r.dx), what + ": dx");
    expect_same_values(g.y.to_vector<float>(), rounded(r.y), what + ": y");
    expect_same_values(g.dexpert_out.to_vector<float>(), rounded(r.dexpert_out), what + ": dexpert_out");
    // dtopk_weight (f32): bf16 inputs, another sum order over H <= 1000.
    constexpr double kBf16Threshold = 1e-5;
    const double err = relative_error(g.dtopk_weight, r.dtopk_weight);
    EXPECT_LT(err, kBf16Threshold) << what << ": dtopk_weight relative error " << err;
  }
}

TEST(CudaPermute, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  Rng rng(24);
  const OpsCase c{2048, 8, 128, 512};
  const Tensor index = random_choices(c.tokens, c.top_k, c.experts, rng);
  const ops::RoutingPlan p1 = plan_on(index, c.experts, gpu()), p2 = plan_on(index, c.experts, gpu());
  EXPECT_TRUE(same_bytes(p1.expert_offsets, p2.expert_offsets)) << "expert_offsets";
  EXPECT_TRUE(same_bytes(p1.row_choice, p2.row_choice)) << "row_choice";
  EXPECT_TRUE(same_bytes(p1.choice_row, p2.choice_row)) << "choice_row";
  for (const DType dtype : {DType::F32, DType::BF16}) {
    const Inputs in = random_inputs(c.tokens, c.top_k, c.hidden, dtype, rng);
    const Results a = run_ops(in, index, c.experts, gpu(), dtype);
    const Results b = run_ops(in, index, c.experts, gpu(), dtype);
    EXPECT_TRUE(same_bytes(a.permuted, b.permuted)) << dtype_name(dtype) << ": permuted";
    EXPECT_TRUE(same_bytes(a.dx, b.dx)) << dtype_name(dtype) << ": dx";
    EXPECT_TRUE(same_bytes(a.y, b.y)) << dtype_name(dtype) << ": y";
    EXPECT_TRUE(same_bytes(a.dexpert_out, b.dexpert_out)) << dtype_name(dtype) << ": dexpert_out";
    EXPECT_TRUE(same_bytes(a.dtopk_weight, b.dtopk_weight)) << dtype_name(dtype) << ": dtopk_weight";
  }
}

TEST(CudaPermute, RejectsWhatTheKernelsDoNotTake) {
  MT_REQUIRE_GPU();
  Rng rng(25);
  const Tensor index = random_choices(4, 2, 3, rng);
  const ops::RoutingPlan plan = plan_on(index, 3, gpu());
  const ops::RoutingPlan cpu_plan = plan_on(index, 3, Device::cpu());
  Stream& s = default_stream(gpu());
  const Tensor x = random_tensor({4, 16}, DType::F32, rng).to(gpu());
  Tensor permuted = Tensor::empty({8, 16}, DType::F32, gpu());
  expect_error(
      [&] {
        ops::permute_forward(s, permuted, random_tensor({4, 16}, DType::F64, rng).to(gpu()), plan);
      },
      "expected x in f32 or bf16 on CUDA");
  expect_error([&] { ops::permute_forward(s, permuted, x, cpu_plan); }, "expected plan.expert_offsets on cuda:0");
  expect_error([&] { ops::permute_forward(Stream::cpu(), permuted, x, plan); },
               "x is on cuda:0 but the stream runs on cpu");
  expect_error([&] { ops::make_routing_plan(Stream::cpu(), index.to(gpu()), 3); },
               "topk_index is on cuda:0 but the stream runs on cpu");
  Tensor y_cpu = Tensor::empty({4, 16}, DType::F32);
  const Tensor weight = random_tensor({4, 2}, DType::F32, rng).to(gpu());
  expect_error([&] { ops::unpermute_forward(s, y_cpu, permuted, weight, plan); }, "expected y on cuda:0");
}

// The _add forms on CUDA: bitwise the op followed by accumulate, for f32 and bf16 rows, a token side of either dtype
// (an f32 residual stream), an addend of the token side's dtype (one kernel) or of the other (the two kernels), and a
// hidden size that walks elements rather than spans.
TEST(CudaPermuteAdd, GivesTheBitsOfTheOpThenAccumulate) {
  MT_REQUIRE_GPU();
  Stream& s = default_stream(gpu());
  for (DType rows_dtype : {DType::F32, DType::BF16}) {
    for (DType token_dtype : {DType::F32, DType::BF16}) {
      for (DType addend_dtype : {DType::F32, DType::BF16}) {
        for (int64_t hidden : {int64_t{2048}, int64_t{36}}) {
          SCOPED_TRACE(::testing::Message()
                       << "rows " << dtype_name(rows_dtype) << " token side " << dtype_name(token_dtype) << " addend "
                       << dtype_name(addend_dtype) << " H " << hidden);
          Rng rng(92);
          const int64_t tokens = 300, top_k = 4, experts = 16;
          const ops::RoutingPlan plan = plan_on(random_choices(tokens, top_k, experts, rng), experts, gpu());
          const Tensor rows = random_tensor({tokens * top_k, hidden}, DType::F32, rng).to(rows_dtype).to(gpu());
          const Tensor weight = random_tensor({tokens, top_k}, DType::F32, rng).to(gpu());
          const Tensor addend = random_tensor({tokens, hidden}, DType::F32, rng).to(addend_dtype).to(gpu());

          const Tensor y = Tensor::empty({tokens, hidden}, token_dtype, gpu());
          ops::unpermute_forward_add(s, y, rows, weight, plan, addend);
          const Tensor want_y = Tensor::empty({tokens, hidden}, token_dtype, gpu());
          ops::unpermute_forward(s, want_y, rows, weight, plan);
          ops::accumulate(s, want_y, addend);
          EXPECT_TRUE(testing::same_bytes(y, want_y)) << "unpermute_forward_add";

          const Tensor dx = Tensor::empty({tokens, hidden}, token_dtype, gpu());
          ops::permute_backward_add(s, dx, rows, plan, addend);
          const Tensor want_dx = Tensor::empty({tokens, hidden}, token_dtype, gpu());
          ops::permute_backward(s, want_dx, rows, plan);
          ops::accumulate(s, want_dx, addend);
          EXPECT_TRUE(testing::same_bytes(dx, want_dx)) << "permute_backward_add";
        }
      }
    }
  }
}

// concat_permuted_rows on CUDA: bitwise permute_forward (unweighted) or unpermute_backward's dexpert_out (weighted)
// of each micro-batch followed by concat_group_rows, for f32 and bf16 rows, weighted tokens of either dtype (an f32
// residual stream's gradient beside bf16 rows), rows that take one batch of loads per lane, more than one and a part
// of one (spans of 8) or walk elements, an empty micro-batch and idle experts, and a top-k wider than a warp (whose
// destinations each lane finds itself); and, in f32, the CPU's bytes.
struct ConcatCase {
  int64_t experts, top_k;
  std::vector<int64_t> token_counts, hiddens;
  std::vector<int32_t> idle;
};

void expect_concat_permuted_rows_bits(const ConcatCase& c) {
  Stream& s = default_stream(gpu());
  for (DType rows_dtype : {DType::F32, DType::BF16}) {
    for (DType token_dtype : {DType::F32, DType::BF16}) {
      for (int64_t hidden : c.hiddens) {
        SCOPED_TRACE(::testing::Message() << "E " << c.experts << " K " << c.top_k << " rows " << dtype_name(rows_dtype)
                                          << " weighted tokens " << dtype_name(token_dtype) << " H " << hidden);
        Rng rng(93);
        std::vector<ops::PermutedRows> plain, weighted, plain_cpu, weighted_cpu;
        std::vector<Tensor> permuted, dexpert_out, offsets;
        int64_t total = 0;
        for (int64_t tokens : c.token_counts) {
          const Tensor choices = random_choices(tokens, c.top_k, c.experts, rng, c.idle);
          const ops::RoutingPlan plan = plan_on(choices, c.experts, gpu());
          const Tensor x = random_tensor({tokens, hidden}, DType::F32, rng).to(rows_dtype).to(gpu());
          const Tensor dy = random_tensor({tokens, hidden}, DType::F32, rng).to(token_dtype).to(gpu());
          const Tensor weight = random_tensor({tokens, c.top_k}, DType::F32, rng).to(gpu());
          plain.push_back({x, Tensor(), plan});
          weighted.push_back({dy, weight, plan});
          const int64_t rows = tokens * c.top_k;
          total += rows;
          permuted.push_back(Tensor::empty({rows, hidden}, rows_dtype, gpu()));
          ops::permute_forward(s, permuted.back(), x, plan);
          dexpert_out.push_back(Tensor::empty({rows, hidden}, rows_dtype, gpu()));
          const Tensor d_weight = Tensor::empty({tokens, c.top_k}, DType::F32, gpu());
          ops::unpermute_backward(s, dexpert_out.back(), d_weight, dy, permuted.back(), weight, plan);
          offsets.push_back(plan.expert_offsets);
          if (rows_dtype == DType::F32 && token_dtype == DType::F32) {
            const ops::RoutingPlan host = ops::make_routing_plan(Stream::cpu(), choices, c.experts);
            plain_cpu.push_back({x.to(Device::cpu()), Tensor(), host});
            weighted_cpu.push_back({dy.to(Device::cpu()), weight.to(Device::cpu()), host});
          }
        }
        for (bool with_weight : {false, true}) {
          const Tensor want = Tensor::empty({total, hidden}, rows_dtype, gpu());
          ops::concat_group_rows(s, want, with_weight ? dexpert_out : permuted, offsets);
          const Tensor got = Tensor::empty({total, hidden}, rows_dtype, gpu());
          ops::concat_permuted_rows(s, got, with_weight ? weighted : plain);
          EXPECT_TRUE(same_bytes(got, want)) << (with_weight ? "weighted" : "plain");
          if (plain_cpu.empty()) continue;
          Tensor on_cpu = Tensor::empty({total, hidden}, DType::F32);
          ops::concat_permuted_rows(Stream::cpu(), on_cpu, with_weight ? weighted_cpu : plain_cpu);
          EXPECT_TRUE(same_bytes(got, on_cpu)) << (with_weight ? "weighted" : "plain") << " against the CPU";
        }
      }
    }
  }
}

TEST(CudaConcatPermutedRows, GivesTheBitsOfTheOpsItFusesAndOfTheCpu) {
  MT_REQUIRE_GPU();
  expect_concat_permuted_rows_bits({16, 4, {300, 0, 517, 64}, {2048, 4104, 36}, {3, 11}});
  expect_concat_permuted_rows_bits({48, 36, {20, 7}, {24, 2048}, {}});
}

TEST(CudaConcatPermutedRows, RefusesUnweightedTokensOfAnotherDtypeAndHostWeights) {
  MT_REQUIRE_GPU();
  Stream& s = default_stream(gpu());
  Rng rng(94);
  const ops::RoutingPlan plan = plan_on(random_choices(8, 2, 4, rng), 4, gpu());
  const Tensor tokens = random_tensor({8, 16}, DType::F32, rng).to(gpu());
  const Tensor out = Tensor::empty({16, 16}, DType::BF16, gpu());
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {{tokens, Tensor(), plan}});
      },
      "concat_permuted_rows (sources[0]): tokens: expected dtype bf16 but found f32");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {{tokens, Tensor::zeros({8, 2}, DType::BF16, gpu()), plan}});
      },
      "concat_permuted_rows (sources[0]): weight: expected dtype f32 but found bf16");
  expect_error(
      [&] {
        ops::concat_permuted_rows(s, out, {{tokens, Tensor::zeros({8, 2}, DType::F32), plan}});
      },
      "concat_permuted_rows (sources[0]): expected weight on cuda:0 but found f32[8, 2] on cpu");
}

}  // namespace
}  // namespace moetrain
