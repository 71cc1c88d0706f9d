// Tests for the Hopper (CUTLASS) path of the grouped expert GEMMs (ops/cuda/grouped_gemm_cutlass.*), reached through
// the public ops with bf16 operands whose N and K are multiples of 8: forward, backward input and backward weight
// against the CPU reference on bf16-rounded inputs over uniform groups, skewed groups with empty ones, one group, no
// rows, odd row counts and more groups than a warp scans at once; weight-gradient accumulation, the launcher's
// overwriting form and its ping-pong schedule, determinism, group independence and the fallback for shapes the path
// does not take. Each comparison prints ||gpu - cpu|| / ||cpu||. CudaGroupedGemmBench.DISABLED_ExpertShapes times the
// Qwen3-30B-A3B expert shapes (run it with --gtest_also_run_disabled_tests; bench/grouped_mm_torch.py times
// torch._grouped_mm on the same ones).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>
#endif

#include "core/rng.h"
#include "ops/grouped_gemm.h"
#include "ops/permute.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/check.h"
#include "ops/cuda/grouped_gemm_cutlass.h"
#include "ops/cuda/runtime.h"
#endif
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

// The CUTLASS path and its launchers exist only in builds with CUDA; without it there is nothing to test here.
#if MOETRAIN_HAS_CUDA

using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::rounded_to_bf16;
using testing::same_bytes;

// bf16 outputs against the CPU's f32 result on the same bf16-valued inputs: the final store rounds each element by at
// most 2^-9 relative (the f32 accumulation differs by ~1e-6); 2^-8 is twice that bound, while one wrong or missing
// term of a K >= 16 reduction costs ~1/sqrt(K) >= 6e-2.
constexpr double kBf16OutputTolerance = 0x1p-8;
// f32 weight gradients: products of bf16 values are exact in f32, so only the summation differs from the CPU's. The
// tensor cores may truncate rather than round while accumulating: at most one f32 ulp (2^-23 relative to the running
// sum) per added product over the longest group here (300 rows) bounds the error by ~3.6e-5; 1e-4 leaves margin,
// while a wrong or missing row costs ~1/sqrt(rows) >= 5e-2.
constexpr double kF32GradientTolerance = 1e-4;

std::vector<int32_t> offsets_from_sizes(const std::vector<int32_t>& sizes) {
  std::vector<int32_t> offsets{0};
  for (int32_t s : sizes) offsets.push_back(offsets.back() + s);
  return offsets;
}

Tensor offsets_tensor(const std::vector<int32_t>& offsets) {
  return Tensor::from_vector<int32_t>(offsets, {static_cast<int64_t>(offsets.size())});
}

void expect_close(const Tensor& gpu_result, const Tensor& cpu_result, double tolerance, const std::string& what) {
  const double err = testing::relative_error(gpu_result, cpu_result);
  std::printf("    %-86s relative error %.3e (threshold %.1e)\n", what.c_str(), err, tolerance);
  EXPECT_LE(err, tolerance) << what << ": ||gpu - cpu|| / ||cpu|| = " << err
                            << ", max |gpu - cpu| = " << testing::max_abs_diff(gpu_result, cpu_result);
}

struct GroupCase {
  std::string name;
  std::vector<int32_t> offsets;
  int64_t n_out, n_in;  // N and K of w [G, N, K]
  int64_t groups() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t rows() const { return offsets.back(); }
};

// N and K multiples of 8 (the CUTLASS path's requirement) but not of the 128 x 256 x 64 tile, so partial tiles along
// every dimension are exercised.
std::vector<GroupCase> cases() {
  std::vector<GroupCase> all;
  all.push_back({"uniform: 8 groups of 128 rows", offsets_from_sizes(std::vector<int32_t>(8, 128)), 256, 512});
  all.push_back(
      {"skewed with empty groups (first, middle, last)", offsets_from_sizes({0, 300, 1, 0, 129, 7, 45, 0}), 136, 200});
  all.push_back({"a single group (G = 1)", offsets_from_sizes({333}), 64, 128});
  all.push_back({"no rows at all (R = 0)", offsets_from_sizes({0, 0, 0}), 16, 32});
  all.push_back({"odd row counts", offsets_from_sizes({1, 3, 255, 17, 129}), 128, 72});
  // Two 256-wide tiles along N and along K, the second partial: the clusters paired along N run on both ops.
  all.push_back({"N and K of two tiles, the second partial", offsets_from_sizes({70, 0, 200, 130}), 392, 264});
  Rng rng(91);
  std::vector<int32_t> small(40);
  for (int32_t& s : small) s = static_cast<int32_t>(rng.below(10));
  all.push_back({"40 groups of 0..9 rows (more than one warp's 32 groups)", offsets_from_sizes(small), 24, 40});
  return all;
}

// f32 tensors on the CPU holding bf16 values (what the GPU sees), plus a random f32 starting dw.
struct Inputs {
  Tensor x, w, dy, dw_start, offsets;
};

Inputs make_inputs(const GroupCase& c, uint64_t seed) {
  Rng rng(seed);
  Inputs in;
  in.x = rounded_to_bf16(random_tensor({c.rows(), c.n_in}, DType::F32, rng));
  in.w = rounded_to_bf16(random_tensor({c.groups(), c.n_out, c.n_in}, DType::F32, rng));
  in.dy = rounded_to_bf16(random_tensor({c.rows(), c.n_out}, DType::F32, rng));
  in.dw_start = random_tensor({c.groups(), c.n_out, c.n_in}, DType::F32, rng);
  in.offsets = offsets_tensor(c.offsets);
  return in;
}

Tensor bf16_gpu(const Tensor& f32) { return on_gpu(f32.to(DType::BF16)); }

// The cases above must take the CUTLASS path (else these tests would check the generic kernels).
void expect_cutlass_path(const GroupCase& c, const Tensor& a, const Tensor& b, const Tensor& out) {
  EXPECT_TRUE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, c.rows(), c.n_out, c.n_in, {&a, &b, &out}))
      << c.name << ": expected the CUTLASS path to take N = " << c.n_out << ", K = " << c.n_in;
}

TEST(CudaGroupedGemmCutlass, ForwardMatchesCpuOnRoundedInputs) {
  MT_REQUIRE_GPU();
  uint64_t seed = 100;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, seed++);
    Tensor want = Tensor::empty({c.rows(), c.n_out}, DType::F32);
    ops::grouped_linear_forward(Stream::cpu(), want, in.x, in.w, in.offsets);
    const Tensor x = bf16_gpu(in.x), w = bf16_gpu(in.w);
    Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, DType::BF16));
    expect_cutlass_path(c, x, w, y);
    ops::grouped_linear_forward(gpu(), y, x, w, on_gpu(in.offsets));
    expect_close(host_f32(y), want, kBf16OutputTolerance, "forward: " + c.name);
  }
}

TEST(CudaGroupedGemmCutlass, BackwardInputMatchesCpuOnRoundedInputs) {
  MT_REQUIRE_GPU();
  uint64_t seed = 200;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, seed++);
    Tensor want = Tensor::empty({c.rows(), c.n_in}, DType::F32);
    ops::grouped_linear_backward_input(Stream::cpu(), want, in.dy, in.w, in.offsets);
    const Tensor dy = bf16_gpu(in.dy), w = bf16_gpu(in.w);
    Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, DType::BF16));
    expect_cutlass_path(c, dy, w, dx);
    ops::grouped_linear_backward_input(gpu(), dx, dy, w, on_gpu(in.offsets));
    expect_close(host_f32(dx), want, kBf16OutputTolerance, "backward_input: " + c.name);
  }
}

// dw starts from random values and the op is called twice: dw = start + 2 * sum, and empty groups keep their start
// bytes.
TEST(CudaGroupedGemmCutlass, BackwardWeightAccumulatesTwiceAndSkipsEmptyGroups) {
  MT_REQUIRE_GPU();
  uint64_t seed = 300;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, seed++);
    Tensor want = in.dw_start.clone();
    ops::grouped_linear_backward_weight(Stream::cpu(), want, in.dy, in.x, in.offsets);
    Tensor want_once = want.clone();
    ops::grouped_linear_backward_weight(Stream::cpu(), want, in.dy, in.x, in.offsets);
    const Tensor dy = bf16_gpu(in.dy), x = bf16_gpu(in.x), offsets = on_gpu(in.offsets);
    Tensor dw = on_gpu(in.dw_start);
    expect_cutlass_path(c, dy, x, dw);
    ops::grouped_linear_backward_weight(gpu(), dw, dy, x, offsets);
    expect_close(host_f32(dw), want_once, kF32GradientTolerance, "backward_weight once: " + c.name);
    ops::grouped_linear_backward_weight(gpu(), dw, dy, x, offsets);
    const Tensor got = host_f32(dw);
    expect_close(got, want, kF32GradientTolerance, "backward_weight twice: " + c.name);
    for (int64_t g = 0; g < c.groups(); ++g) {
      if (c.offsets[g] != c.offsets[g + 1]) continue;
      EXPECT_TRUE(same_bytes(got.select(g).clone(), in.dw_start.select(g).clone()))
          << c.name << ": empty group " << g << " changed its gradient";
    }
  }
}

// The launcher's overwriting form (accumulate = false) ignores dw's previous contents: dw[g] = dy_g^T x_g, and empty
// groups become 0 (also when there are no rows at all).
TEST(CudaGroupedGemmCutlass, BackwardWeightOverwriteIgnoresPreviousContentsAndZeroesEmptyGroups) {
  MT_REQUIRE_GPU();
  uint64_t seed = 700;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, seed++);
    Tensor want = Tensor::zeros({c.groups(), c.n_out, c.n_in}, DType::F32);
    ops::grouped_linear_backward_weight(Stream::cpu(), want, in.dy, in.x, in.offsets);
    Tensor dw = on_gpu(in.dw_start);
    ops::cuda::grouped_linear_backward_weight_cutlass(gpu(), dw, bf16_gpu(in.dy), bf16_gpu(in.x), on_gpu(in.offsets),
                                                      /*accumulate=*/false);
    const Tensor got = host_f32(dw);
    expect_close(got, want, kF32GradientTolerance, "backward_weight overwrite: " + c.name);
    for (int64_t g = 0; g < c.groups(); ++g) {
      if (c.offsets[g] != c.offsets[g + 1]) continue;
      const std::vector<float> values = got.select(g).clone().to_vector<float>();
      EXPECT_TRUE(std::all_of(values.begin(), values.end(), [](float v) { return v == 0.0f; }))
          << c.name << ": empty group " << g << " was not zeroed";
    }
  }
}

// The public op's overwriting form (a step's first write, GradientWrite::Overwrite) gives the bytes of accumulating
// onto zeros, whatever dw held before: on CUTLASS (bf16) and on the generic kernels (f32 inputs).
TEST(CudaGroupedGemmCutlass, PublicOverwriteGivesTheBytesOfAccumulatingOntoZeros) {
  MT_REQUIRE_GPU();
  uint64_t seed = 800;
  for (const GroupCase& c : cases()) {
    for (DType dtype : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(c.name + " " + std::string(dtype_name(dtype)));
      const Inputs in = make_inputs(c, seed++);
      const Tensor dy = on_gpu(in.dy.to(dtype)), x = on_gpu(in.x.to(dtype)), offsets = on_gpu(in.offsets);
      Tensor onto_zeros = on_gpu(Tensor::zeros({c.groups(), c.n_out, c.n_in}, DType::F32));
      if (dtype == DType::BF16) expect_cutlass_path(c, dy, x, onto_zeros);
      ops::grouped_linear_backward_weight(gpu(), onto_zeros, dy, x, offsets);
      Tensor dw = on_gpu(in.dw_start);
      ops::grouped_linear_backward_weight(gpu(), dw, dy, x, offsets, ops::GradientWrite::Overwrite);
      EXPECT_TRUE(same_bytes(host_f32(dw), host_f32(onto_zeros)));
    }
  }
}

// The ping-pong weight gradient (GroupedGemmSchedule::Pingpong) accumulates and overwrites like the cooperative one:
// against the CPU as closely, and with the same bytes, because both run the same 64 x 256 x 16 wgmma over the same
// k-blocks in the same order per output element and the same epilogue arithmetic (acc + C, or acc alone); only which
// warp group computes a tile and when differ. The same bytes let it replace the cooperative kernel without changing
// any bitwise result. Overwriting (the step's expert gradients written once), the stale dw it starts from is never
// read and empty groups get zeros.
TEST(CudaGroupedGemmCutlass, BackwardWeightPingpongAccumulatesAndOverwritesWithTheCooperativeBytes) {
  MT_REQUIRE_GPU();
  uint64_t seed = 900;
  for (const GroupCase& c : cases()) {
    for (const bool accumulate : {true, false}) {
      const std::string what = c.name + (accumulate ? ", accumulating" : ", overwriting");
      SCOPED_TRACE(what);
      const Inputs in = make_inputs(c, seed++);
      Tensor want = accumulate ? in.dw_start.clone() : Tensor::zeros({c.groups(), c.n_out, c.n_in}, DType::F32);
      ops::grouped_linear_backward_weight(Stream::cpu(), want, in.dy, in.x, in.offsets);
      const Tensor dy = bf16_gpu(in.dy), x = bf16_gpu(in.x), offsets = on_gpu(in.offsets);
      Tensor cooperative = on_gpu(in.dw_start), pingpong = on_gpu(in.dw_start);
      ops::cuda::grouped_linear_backward_weight_cutlass(gpu(), cooperative, dy, x, offsets, accumulate,
                                                        ops::cuda::GroupedGemmSchedule::Cooperative);
      ops::cuda::grouped_linear_backward_weight_cutlass(gpu(), pingpong, dy, x, offsets, accumulate,
                                                        ops::cuda::GroupedGemmSchedule::Pingpong);
      const Tensor got = host_f32(pingpong);
      expect_close(got, want, kF32GradientTolerance, "backward_weight ping-pong: " + what);
      EXPECT_TRUE(same_bytes(got, host_f32(cooperative))) << what << ": ping-pong and cooperative bytes differ";
    }
  }
}

// The forward and the backward input on the ping-pong schedule (64-row tiles) and on every cluster shape give the
// cooperative schedule's bytes, for the same reason: each output element's k-blocks in the same order through the same
// wgmma. The cluster only changes which CTAs share an operand tile and which tiles are padding.
TEST(CudaGroupedGemmCutlass, ForwardAndBackwardInputOnEveryScheduleAndClusterGiveTheCooperativeBytes) {
  MT_REQUIRE_GPU();
  using ops::cuda::GroupedGemmCluster;
  using ops::cuda::GroupedGemmSchedule;
  uint64_t seed = 950;
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, seed++);
    const Tensor x = bf16_gpu(in.x), w = bf16_gpu(in.w), dy = bf16_gpu(in.dy), offsets = on_gpu(in.offsets);
    Tensor want = Tensor::empty({c.rows(), c.n_out}, DType::F32);
    ops::grouped_linear_forward(Stream::cpu(), want, in.x, in.w, in.offsets);
    auto run = [&](GroupedGemmSchedule schedule, GroupedGemmCluster cluster) {
      Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, DType::BF16));
      Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, DType::BF16));
      ops::cuda::grouped_linear_forward_cutlass(gpu(), y, x, w, offsets, schedule, cluster);
      ops::cuda::grouped_linear_backward_input_cutlass(gpu(), dx, dy, w, offsets, schedule, cluster);
      return std::pair{y.to(Device::cpu()), dx.to(Device::cpu())};
    };
    const auto [y_cooperative, dx_cooperative] = run(GroupedGemmSchedule::Cooperative, GroupedGemmCluster::PairAlongM);
    for (auto [schedule, schedule_name] : {std::pair{GroupedGemmSchedule::Cooperative, "cooperative"},
                                           std::pair{GroupedGemmSchedule::Pingpong, "ping-pong"}}) {
      for (auto [cluster, cluster_name] : {std::pair{GroupedGemmCluster::PairAlongM, "pairs along M"},
                                           std::pair{GroupedGemmCluster::Single, "one CTA"},
                                           std::pair{GroupedGemmCluster::PairAlongN, "pairs along N"}}) {
        const std::string what = c.name + ", " + schedule_name + ", " + cluster_name;
        const auto [y, dx] = run(schedule, cluster);
        expect_close(host_f32(y), want, kBf16OutputTolerance, "forward: " + what);
        EXPECT_TRUE(same_bytes(y, y_cooperative)) << what << ": forward bytes differ";
        EXPECT_TRUE(same_bytes(dx, dx_cooperative)) << what << ": backward input bytes differ";
      }
    }
  }
}

// Each token's top_k distinct experts: at random over all experts, or (skewed) mostly among the first top_k + 2, so
// that most groups are long and many of the rest empty.
Tensor random_topk_index(int64_t tokens, int64_t top_k, int64_t experts, bool skewed, Rng& rng) {
  std::vector<int32_t> chosen;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> mine;
    while (static_cast<int64_t>(mine.size()) < top_k) {
      const int64_t pool = skewed && rng.below(8) != 0 ? std::min(experts, top_k + 2) : experts;
      const auto e = static_cast<int32_t>(rng.below(static_cast<uint64_t>(pool)));
      if (std::find(mine.begin(), mine.end(), e) == mine.end()) mine.push_back(e);
    }
    chosen.insert(chosen.end(), mine.begin(), mine.end());
  }
  return Tensor::from_vector<int32_t>(chosen, {tokens, top_k});
}

// The forward over routed rows gathered inside the GEMM's loads gives the bytes of permute_forward followed by the
// forward, and stays within the bf16 bound of the CPU's: K of one partial 64-column block, of several with the last
// partial, and of 2,048 (the workload's); groups long, short, one row and empty; N of partial 256-wide tiles.
TEST(CudaGroupedGemmCutlass, ForwardGatheredGivesTheBytesOfPermuteThenForward) {
  MT_REQUIRE_GPU();
  struct Case {
    const char* name;
    int64_t tokens, top_k, experts, n_out, n_in;
    bool skewed;
  };
  uint64_t seed = 1210;
  for (const Case& c :
       {Case{"300 tokens, top-4 of 16 experts, N 200, K 136", 300, 4, 16, 200, 136, false},
        Case{"skewed: 700 tokens, top-8 of 64 experts, N 256, K 2048", 700, 8, 64, 256, 2048, true},
        Case{"one token, top-2 of 8 experts, N 64, K 40", 1, 2, 8, 64, 40, false},
        Case{"skewed: 1000 tokens, top-2 of 128 experts, N 392, K 264", 1000, 2, 128, 392, 264, true}}) {
    SCOPED_TRACE(c.name);
    Rng rng(seed++);
    const int64_t rows = c.tokens * c.top_k;
    const Tensor topk_index = random_topk_index(c.tokens, c.top_k, c.experts, c.skewed, rng);
    const ops::RoutingPlan plan = ops::make_routing_plan(gpu(), on_gpu(topk_index), c.experts);
    const Tensor x_host = rounded_to_bf16(random_tensor({c.tokens, c.n_in}, DType::F32, rng));
    const Tensor w_host = rounded_to_bf16(random_tensor({c.experts, c.n_out, c.n_in}, DType::F32, rng));
    const Tensor x = bf16_gpu(x_host), w = bf16_gpu(w_host);
    ASSERT_TRUE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, rows, c.n_out, c.n_in, {&x, &w}));
    Tensor permuted = on_gpu(Tensor::zeros({rows, c.n_in}, DType::BF16));
    ops::permute_forward(gpu(), permuted, x, plan);
    Tensor want = on_gpu(Tensor::zeros({rows, c.n_out}, DType::BF16));
    ops::grouped_linear_forward(gpu(), want, permuted, w, plan.expert_offsets);
    // Filled with 7s first, so that a row the kernel skipped would show.
    Tensor got = bf16_gpu(
        Tensor::from_vector<float>(std::vector<float>(static_cast<size_t>(rows * c.n_out), 7.0f), {rows, c.n_out}));
    ops::grouped_linear_forward_gathered(gpu(), got, x, plan, w);
    EXPECT_TRUE(same_bytes(got.to(Device::cpu()), want.to(Device::cpu()))) << "the gathered forward's bytes differ";
    const ops::RoutingPlan host_plan = ops::make_routing_plan(Stream::cpu(), topk_index, c.experts);
    Tensor permuted_host = Tensor::empty({rows, c.n_in}, DType::F32);
    ops::permute_forward(Stream::cpu(), permuted_host, x_host, host_plan);
    Tensor cpu = Tensor::empty({rows, c.n_out}, DType::F32);
    ops::grouped_linear_forward(Stream::cpu(), cpu, permuted_host, w_host, host_plan.expert_offsets);
    expect_close(host_f32(got), cpu, kBf16OutputTolerance, std::string("gathered forward: ") + c.name);
  }
}

TEST(CudaGroupedGemmCutlass, RepeatedRunsAreBitwiseIdentical) {
  MT_REQUIRE_GPU();
  for (const GroupCase& c : cases()) {
    SCOPED_TRACE(c.name);
    const Inputs in = make_inputs(c, 400);
    const Tensor x = bf16_gpu(in.x), w = bf16_gpu(in.w), dy = bf16_gpu(in.dy), offsets = on_gpu(in.offsets);
    Tensor results[2][3];
    for (auto& r : results) {
      Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, DType::BF16));
      Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, DType::BF16));
      Tensor dw = on_gpu(in.dw_start);
      ops::grouped_linear_forward(gpu(), y, x, w, offsets);
      ops::grouped_linear_backward_input(gpu(), dx, dy, w, offsets);
      ops::grouped_linear_backward_weight(gpu(), dw, dy, x, offsets);
      r[0] = y.to(Device::cpu());
      r[1] = dx.to(Device::cpu());
      r[2] = dw.to(Device::cpu());
    }
    EXPECT_TRUE(same_bytes(results[0][0], results[1][0])) << "forward";
    EXPECT_TRUE(same_bytes(results[0][1], results[1][1])) << "backward_input";
    EXPECT_TRUE(same_bytes(results[0][2], results[1][2])) << "backward_weight";
  }
}

// A group's results do not depend on the other groups: group 1 of the skewed case (rows 0..300) computed with every
// other group emptied gives the same bytes for its rows (forward, backward input) and for dw[1].
TEST(CudaGroupedGemmCutlass, GroupResultsDoNotDependOnOtherGroups) {
  MT_REQUIRE_GPU();
  const GroupCase c = cases()[1];
  ASSERT_EQ(c.offsets[1], 0);
  ASSERT_EQ(c.offsets[2], 300);
  const Inputs in = make_inputs(c, 500);
  const Tensor x = bf16_gpu(in.x), w = bf16_gpu(in.w), dy = bf16_gpu(in.dy);
  Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, DType::BF16));
  Tensor dx = on_gpu(Tensor::zeros({c.rows(), c.n_in}, DType::BF16));
  Tensor dw = on_gpu(in.dw_start);
  ops::grouped_linear_forward(gpu(), y, x, w, on_gpu(in.offsets));
  ops::grouped_linear_backward_input(gpu(), dx, dy, w, on_gpu(in.offsets));
  ops::grouped_linear_backward_weight(gpu(), dw, dy, x, on_gpu(in.offsets));

  const int64_t count = 300;
  std::vector<int32_t> alone(c.offsets.size(), static_cast<int32_t>(count));
  alone[0] = alone[1] = 0;
  const Tensor alone_offsets = on_gpu(offsets_tensor(alone));
  Tensor y_alone = on_gpu(Tensor::zeros({count, c.n_out}, DType::BF16));
  Tensor dx_alone = on_gpu(Tensor::zeros({count, c.n_in}, DType::BF16));
  Tensor dw_alone = on_gpu(in.dw_start);
  ops::grouped_linear_forward(gpu(), y_alone, x.slice(0, count), w, alone_offsets);
  ops::grouped_linear_backward_input(gpu(), dx_alone, dy.slice(0, count), w, alone_offsets);
  ops::grouped_linear_backward_weight(gpu(), dw_alone, dy.slice(0, count), x.slice(0, count), alone_offsets);
  EXPECT_TRUE(same_bytes(y_alone, y.to(Device::cpu()).slice(0, count).clone())) << "forward";
  EXPECT_TRUE(same_bytes(dx_alone, dx.to(Device::cpu()).slice(0, count).clone())) << "backward_input";
  EXPECT_TRUE(same_bytes(dw_alone.to(Device::cpu()).select(1).clone(), dw.to(Device::cpu()).select(1).clone()))
      << "backward_weight of group 1";
}

// Shapes the CUTLASS path does not take (N or K not a multiple of 8, f32) still run, on the generic kernels.
// The gathered forward's row sources are 32-bit offsets in 16-byte units: a token matrix of 2^35 elements or more takes
// permute_forward and the forward instead (host arithmetic: no GPU, and no 64 GiB tensor, needed).
TEST(CudaGroupedGemmCutlass, GatheredRowsFitBelow2To35TokenElements) {
  EXPECT_TRUE(ops::cuda::cutlass_gathered_rows_fit(0));
  EXPECT_TRUE(ops::cuda::cutlass_gathered_rows_fit(8192LL * 2048));  // the workload of record's tokens
  EXPECT_TRUE(ops::cuda::cutlass_gathered_rows_fit((int64_t{1} << 35) - 1));
  EXPECT_FALSE(ops::cuda::cutlass_gathered_rows_fit(int64_t{1} << 35));
}

TEST(CudaGroupedGemmCutlass, UnalignedShapesFallBackToTheGenericKernels) {
  MT_REQUIRE_GPU();
  const GroupCase c{"N = 12 (not a multiple of 8)", offsets_from_sizes({5, 0, 70}), 12, 32};
  const Inputs in = make_inputs(c, 600);
  const Tensor x = bf16_gpu(in.x), w = bf16_gpu(in.w);
  Tensor y = on_gpu(Tensor::zeros({c.rows(), c.n_out}, DType::BF16));
  EXPECT_FALSE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, c.rows(), c.n_out, c.n_in, {&x, &w, &y}));
  EXPECT_FALSE(ops::cuda::cutlass_grouped_gemm_supported(DType::F32, c.rows(), 16, 32, {}));
  EXPECT_FALSE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, c.rows(), 16, 36, {}));
  EXPECT_TRUE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, c.rows(), 16, 40, {}));
  Tensor want = Tensor::empty({c.rows(), c.n_out}, DType::F32);
  ops::grouped_linear_forward(Stream::cpu(), want, in.x, in.w, in.offsets);
  ops::grouped_linear_forward(gpu(), y, x, w, on_gpu(in.offsets));
  expect_close(host_f32(y), want, kBf16OutputTolerance, "forward (generic kernel): " + c.name);
}

// ---------------------------------------------------------------------------------------------------------------
// Benchmark: the Qwen3-30B-A3B expert GEMMs (E = 128, H = 2048, I = 768, 65,536 routed rows) and DeepSeek-V2-Lite's
// (E = 64, H = 2048, I = 1408, 24,576 routed rows), bf16 in, f32 accumulate. Uniform routing (512 rows per expert), a
// random one (each row to an expert drawn uniformly, as a freshly initialised router routes: the groups a few dozen
// rows off a multiple of 128) and a Zipf-like skew (expert e gets a share ~ 1 / (e + 1)^1.2, the last 16 experts
// none); bench/grouped_mm_torch.py builds the uniform and the skewed routing.

enum class BenchRouting { Uniform, Random, Skewed };

std::vector<int32_t> bench_sizes(BenchRouting routing, int experts, int rows) {
  std::vector<int32_t> sizes(experts, rows / experts);
  if (routing == BenchRouting::Uniform) return sizes;
  if (routing == BenchRouting::Random) {  // each row to an expert drawn uniformly: 512 +- 22 rows on the workload
    std::fill(sizes.begin(), sizes.end(), 0);
    Rng rng(11);
    for (int r = 0; r < rows; ++r) ++sizes[rng.below(static_cast<uint64_t>(experts))];
    return sizes;
  }
  const int active = experts - 16;
  std::vector<double> share(experts, 0.0);
  double total = 0.0;
  for (int e = 0; e < active; ++e) total += share[e] = 1.0 / std::pow(e + 1.0, 1.2);
  int assigned = 0;
  for (int e = 0; e < experts; ++e) {
    sizes[e] = static_cast<int32_t>(std::floor(rows * share[e] / total));
    assigned += sizes[e];
  }
  sizes[0] += rows - assigned;
  return sizes;
}

// A device bf16 tensor filled with a repeated block of random values (generating 10^8 normals on the host is slow;
// the values only need to look like data to the tensor cores).
Tensor bench_tensor(const Shape& shape, Rng& rng) {
  Tensor t = Tensor::empty(shape, DType::BF16, Device::cuda(0));
  const int64_t block = std::min<int64_t>(t.numel(), int64_t{1} << 20);
  const Tensor pattern = random_tensor({block}, DType::F32, rng).to(DType::BF16);
  auto* dst = static_cast<uint8_t*>(t.raw_data());
  for (int64_t at = 0; at < t.numel(); at += block) {
    const int64_t n = std::min(block, t.numel() - at);
    copy_bytes(dst + at * 2, Device::cuda(0), pattern.raw_data(), Device::cpu(), static_cast<size_t>(n) * 2);
  }
  return t;
}

template <typename F>
double time_ms(F&& call) {
  auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(gpu()));
  for (int i = 0; i < 3; ++i) call();
  cudaEvent_t start, stop;
  MT_CUDA_CHECK(cudaEventCreate(&start));
  MT_CUDA_CHECK(cudaEventCreate(&stop));
  constexpr int kTimed = 20;
  MT_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < kTimed; ++i) call();
  MT_CUDA_CHECK(cudaEventRecord(stop, stream));
  MT_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  MT_CUDA_CHECK(cudaEventDestroy(start));
  MT_CUDA_CHECK(cudaEventDestroy(stop));
  return static_cast<double>(ms) / kTimed;
}

struct ExpertShape {
  const char* name;
  int experts, rows;
  int64_t n_out, n_in;
};

// The expert GEMMs of the workload of record (a micro-batch: 8192 tokens, top-8 of 128) and DeepSeek-V2-Lite's
// (bench/deepseek_v2_lite, a micro-batch: 4096 tokens, top-6 of 64, expert width 1408), over the routed rows of
// `workload_micro_batches` and `deepseek_micro_batches` micro-batches.
std::vector<ExpertShape> expert_shapes(int workload_micro_batches, int deepseek_micro_batches) {
  const int workload_rows = 65536 * workload_micro_batches, deepseek_rows = 24576 * deepseek_micro_batches;
  return {{"gate_up (N=1536, K=2048)", 128, workload_rows, 1536, 2048},
          {"down (N=2048, K=768)", 128, workload_rows, 2048, 768},
          {"v2-lite gate_up (N=2816, K=2048)", 64, deepseek_rows, 2816, 2048},
          {"v2-lite down (N=2048, K=1408)", 64, deepseek_rows, 2048, 1408}};
}

TEST(CudaGroupedGemmBench, DISABLED_ExpertShapes) {
  MT_REQUIRE_GPU();
  Rng rng(7);
  std::printf("moetrain CUTLASS grouped GEMM: bf16 in, f32 accumulate\n");
  for (const ExpertShape& s : expert_shapes(1, 1)) {
    std::printf("  %s: %d experts, %d rows\n", s.name, s.experts, s.rows);
    const Tensor x = bench_tensor({s.rows, s.n_in}, rng), w = bench_tensor({s.experts, s.n_out, s.n_in}, rng);
    const Tensor dy = bench_tensor({s.rows, s.n_out}, rng);
    Tensor y = Tensor::empty({s.rows, s.n_out}, DType::BF16, Device::cuda(0));
    Tensor dx = Tensor::empty({s.rows, s.n_in}, DType::BF16, Device::cuda(0));
    Tensor dw = Tensor::zeros({s.experts, s.n_out, s.n_in}, DType::F32, Device::cuda(0));
    for (BenchRouting routing_case : {BenchRouting::Uniform, BenchRouting::Random, BenchRouting::Skewed}) {
      const std::vector<int32_t> sizes = bench_sizes(routing_case, s.experts, s.rows);
      const Tensor offsets = on_gpu(offsets_tensor(offsets_from_sizes(sizes)));
      ASSERT_TRUE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, s.rows, s.n_out, s.n_in, {&x, &w, &y}));
      const double flops = 2.0 * s.rows * static_cast<double>(s.n_out) * static_cast<double>(s.n_in);
      // Every schedule and cluster of the routed-row ops: pp = ping-pong, co = cooperative; 2x1 = pairs along M,
      // 1x1 = one CTA, 1x2 = pairs along N.
      std::vector<std::pair<std::string, double>> timings;
      for (auto [schedule, schedule_name] : {std::pair{ops::cuda::GroupedGemmSchedule::Cooperative, "co"},
                                             std::pair{ops::cuda::GroupedGemmSchedule::Pingpong, "pp"}}) {
        for (auto [cluster, cluster_name] : {std::pair{ops::cuda::GroupedGemmCluster::PairAlongM, "2x1"},
                                             std::pair{ops::cuda::GroupedGemmCluster::Single, "1x1"},
                                             std::pair{ops::cuda::GroupedGemmCluster::PairAlongN, "1x2"}}) {
          const std::string tag = std::string("(") + schedule_name + " " + cluster_name + ")";
          timings.emplace_back("fwd" + tag, time_ms([&] {
                                 ops::cuda::grouped_linear_forward_cutlass(gpu(), y, x, w, offsets, schedule, cluster);
                               }));
          timings.emplace_back("dgrad" + tag, time_ms([&] {
                                 ops::cuda::grouped_linear_backward_input_cutlass(gpu(), dx, dy, w, offsets, schedule,
                                                                                  cluster);
                               }));
        }
      }
      const double wgrad = time_ms([&] { ops::grouped_linear_backward_weight(gpu(), dw, dy, x, offsets); });
      const double wgrad_overwrite = time_ms(
          [&] { ops::cuda::grouped_linear_backward_weight_cutlass(gpu(), dw, dy, x, offsets, /*accumulate=*/false); });
      const double wgrad_pingpong = time_ms([&] {
        ops::cuda::grouped_linear_backward_weight_cutlass(gpu(), dw, dy, x, offsets, /*accumulate=*/true,
                                                          ops::cuda::GroupedGemmSchedule::Pingpong);
      });
      const char* routing = routing_case == BenchRouting::Skewed   ? "skewed (Zipf 1.2, 16 empty, max "
                            : routing_case == BenchRouting::Random ? "random (max "
                                                                   : "uniform (";
      const int32_t largest = *std::max_element(sizes.begin(), sizes.end());
      timings.emplace_back("wgrad", wgrad);
      timings.emplace_back("wgrad(overwrite)", wgrad_overwrite);
      timings.emplace_back("wgrad(ping-pong)", wgrad_pingpong);
      for (const auto& [op, ms] : timings) {
        std::printf("  %-26s %s%d rows) %-16s %8.3f ms %7.1f TFLOP/s\n", s.name, routing, largest, op.c_str(), ms,
                    flops / (ms * 1e-3) / 1e12);
      }
    }
  }
}

// Benchmark: the expert weight gradients once a step (model.expert_weight_gradient = step), written once over a step's
// rows: the workload of record's 8 micro-batches (524,288 routed rows) and DeepSeek-V2-Lite's 4 (98,304), random
// routing, on the cooperative and the ping-pong schedule.
TEST(CudaGroupedGemmBench, DISABLED_ExpertWeightGradientOverAStep) {
  MT_REQUIRE_GPU();
  Rng rng(8);
  std::printf("moetrain CUTLASS grouped weight gradient over a step: bf16 in, f32 written once\n");
  for (const ExpertShape& s : expert_shapes(8, 4)) {
    const Tensor x = bench_tensor({s.rows, s.n_in}, rng), dy = bench_tensor({s.rows, s.n_out}, rng);
    Tensor dw = Tensor::zeros({s.experts, s.n_out, s.n_in}, DType::F32, Device::cuda(0));
    const std::vector<int32_t> sizes = bench_sizes(BenchRouting::Random, s.experts, s.rows);
    const Tensor offsets = on_gpu(offsets_tensor(offsets_from_sizes(sizes)));
    ASSERT_TRUE(ops::cuda::cutlass_grouped_gemm_supported(DType::BF16, s.rows, s.n_out, s.n_in, {&x, &dy, &dw}));
    const double flops = 2.0 * s.rows * static_cast<double>(s.n_out) * static_cast<double>(s.n_in);
    for (auto [schedule, name] : {std::pair{ops::cuda::GroupedGemmSchedule::Cooperative, "cooperative"},
                                  std::pair{ops::cuda::GroupedGemmSchedule::Pingpong, "ping-pong"}}) {
      const double ms = time_ms([&] {
        ops::cuda::grouped_linear_backward_weight_cutlass(gpu(), dw, dy, x, offsets, /*accumulate=*/false, schedule);
      });
      std::printf("  %-34s %d experts, %d rows: overwrite %-12s %8.3f ms %7.1f TFLOP/s\n", s.name, s.experts, s.rows,
                  name, ms, flops / (ms * 1e-3) / 1e12);
    }
  }
}

// Benchmark: the gate_up forward over routed rows gathered inside the GEMM's loads against permute_forward followed by
// the forward over the permuted copy (and the forward alone), at the workload of record's shape (8,192 tokens, top-8
// of 128 experts, N 1,536, K 2,048) and DeepSeek-V2-Lite's (8,192 tokens, top-6 of 64, N 2,816, K 2,048), random
// routing.
TEST(CudaGroupedGemmBench, DISABLED_GatheredForward) {
  MT_REQUIRE_GPU();
  struct Shape3 {
    const char* name;
    int64_t tokens, top_k, experts, n_out, n_in;
  };
  Rng rng(11);
  for (const Shape3& s : {Shape3{"qwen3_30b_a3b gate_up", 8192, 8, 128, 1536, 2048},
                          Shape3{"deepseek_v2_lite gate_up", 8192, 6, 64, 2816, 2048}}) {
    const int64_t rows = s.tokens * s.top_k;
    const ops::RoutingPlan plan =
        ops::make_routing_plan(gpu(), on_gpu(random_topk_index(s.tokens, s.top_k, s.experts, false, rng)), s.experts);
    const Tensor x = bench_tensor({s.tokens, s.n_in}, rng), w = bench_tensor({s.experts, s.n_out, s.n_in}, rng);
    Tensor permuted = Tensor::empty({rows, s.n_in}, DType::BF16, Device::cuda(0));
    Tensor y = Tensor::empty({rows, s.n_out}, DType::BF16, Device::cuda(0));
    const double flops = 2.0 * rows * static_cast<double>(s.n_out) * static_cast<double>(s.n_in);
    const double permute = time_ms([&] { ops::permute_forward(gpu(), permuted, x, plan); });
    const double forward =
        time_ms([&] { ops::cuda::grouped_linear_forward_cutlass(gpu(), y, permuted, w, plan.expert_offsets); });
    const double gathered = time_ms([&] { ops::grouped_linear_forward_gathered(gpu(), y, x, plan, w); });
    // The gathered kernel copying the permuted copy's rows in order: its loads' own cost, apart from the scattered
    // rows' memory traffic.
    std::vector<int32_t> in_order(static_cast<size_t>(rows));
    std::iota(in_order.begin(), in_order.end(), 0);
    const Tensor identity = on_gpu(offsets_tensor(in_order));
    const double copied_in_order = time_ms([&] {
      ops::cuda::grouped_linear_forward_gathered_cutlass(gpu(), y, permuted, identity, 1, w, plan.expert_offsets);
    });
    std::printf(
        "  %-26s permute_forward %7.3f ms + forward %7.3f ms (%6.1f TFLOP/s) = %7.3f ms; gathered %7.3f ms "
        "(%6.1f TFLOP/s): %.3fx; the permuted rows copied in order %7.3f ms\n",
        s.name, permute, forward, flops / (forward * 1e-3) / 1e12, permute + forward, gathered,
        flops / (gathered * 1e-3) / 1e12, (permute + forward) / gathered, copied_in_order);
  }
}

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace moetrain
