// Tests for the CUDA optimizer kernels (ops/cuda/optim.*) through the public ops: AdamW bit for bit against the CPU
// over several steps (both lerp branches, with and without weight decay), sums of squares, the global norm and
// clipping against the CPU, determinism and argument checks; the multi-tensor AdamW (one launch) bit for bit against
// the per-tensor CUDA op and the CPU, its bf16/f32 compute copies against a cast, moments kept in bf16, its cached
// device table, and its argument checks. Run on a GPU; skipped elsewhere. CudaAdamWBench.DISABLED_BesideGemms measures
// how much of an AdamW step hides behind GEMMs queued on the other stream (run it with
// --gtest_also_run_disabled_tests).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/gemm.h"
#include "ops/optim.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/optim.h"
#include "ops/cuda/runtime.h"
#endif
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using testing::expect_error;
using testing::gpu;
using testing::on_cpu;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;
using testing::same_bytes;

// Fails with the first differing element when two host f32 tensors differ in any bit.
void expect_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const std::vector<float> a = got.to_vector<float>(), b = want.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": first difference at element " << i << ": got " << a[i] << ", want " << b[i];
      return;
    }
  }
}

TEST(CudaOptim, AdamWMatchesCpuBitwiseOverSeveralSteps) {
  MT_REQUIRE_GPU();
  // Every step is one correctly rounded f32 operation on both sides, with the same f32 scalars: the same bits.
  struct Setting {
    double beta1;  // 0.9: lerp's small-weight branch (1 - b1 < 0.5); 0.3: the other one
    double weight_decay;
  };
  for (const Setting& s : {Setting{0.9, 0.0}, Setting{0.9, 0.1}, Setting{0.3, 0.01}}) {
    for (int64_t n : {int64_t(1), int64_t(1000), int64_t(100003)}) {
      SCOPED_TRACE(::testing::Message() << "beta1 " << s.beta1 << " wd " << s.weight_decay << " n " << n);
      Rng rng(81);
      Tensor p_cpu = random_tensor({n}, DType::F32, rng);
      Tensor m_cpu = Tensor::zeros({n}, DType::F32);
      Tensor v_cpu = Tensor::zeros({n}, DType::F32);
      Tensor p_gpu = on_gpu(p_cpu), m_gpu = on_gpu(m_cpu), v_gpu = on_gpu(v_cpu);
      for (int64_t step = 1; step <= 5; ++step) {
        const Tensor grad = random_tensor({n}, DType::F32, rng, 1e-2);
        const ops::AdamWParams params{3e-4, s.beta1, 0.95, 1e-8, s.weight_decay, step};
        ops::adamw_step(Stream::cpu(), p_cpu, m_cpu, v_cpu, grad, params);
        ops::adamw_step(gpu(), p_gpu, m_gpu, v_gpu, on_gpu(grad), params);
      }
      expect_same_bits(on_cpu(p_gpu), p_cpu, "param");
      expect_same_bits(on_cpu(m_gpu), m_cpu, "exp_avg");
      expect_same_bits(on_cpu(v_gpu), v_cpu, "exp_avg_sq");
    }
  }
}

TEST(CudaOptim, SumOfSquaresMatchesCpuAndRepeatsExactly) {
  MT_REQUIRE_GPU();
  // f32 squares are exact in f64; only the summation order differs (ascending vs two fixed trees), each addition
  // erring by 1.1e-16 relative: 1e-12 is far above that and far below any real error.
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(4095), int64_t(4096), int64_t(4097), int64_t(1000003)}) {
    SCOPED_TRACE(n);
    Rng rng(82);
    const Tensor x = random_tensor({n}, DType::F32, rng);
    const double want = ops::sum_of_squares(Stream::cpu(), x);
    const Tensor xg = on_gpu(x);
    const double got = ops::sum_of_squares(gpu(), xg);
    EXPECT_NEAR(got, want, 1e-12 * want);
    EXPECT_EQ(ops::sum_of_squares(gpu(), xg), got) << "second run";
  }
}

TEST(CudaOptim, GlobalNormAndClippingMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(83);
  std::vector<Tensor> cpu_grads;
  for (const Shape& shape : {Shape{1000, 64}, Shape{7}, Shape{0}, Shape{4096, 3}, Shape{100003}}) {
    cpu_grads.push_back(random_tensor(shape, DType::F32, rng, 0.1));
  }
  std::vector<Tensor> gpu_grads;
  for (const Tensor& g : cpu_grads) gpu_grads.push_back(on_gpu(g));
  const double want = ops::global_norm(Stream::cpu(), cpu_grads);
  const double got = ops::global_norm(gpu(), gpu_grads);
  EXPECT_NEAR(got, want, 1e-12 * want);

  // No clip: the gradients keep their bits.
  EXPECT_NEAR(ops::clip_by_global_norm(gpu(), gpu_grads, 10.0 * want), want, 1e-12 * want);
  for (size_t i = 0; i < cpu_grads.size(); ++i) expect_same_bits(on_cpu(gpu_grads[i]), cpu_grads[i], "unclipped");

  // A clip to a quarter: the coefficient comes from norms equal to ~1e-15 relative, so its f32 rounding may differ
  // by one ulp: the scaled values agree to 1e-7 relative (1e-6 with the product's own rounding).
  const double norm_cpu = ops::clip_by_global_norm(Stream::cpu(), cpu_grads, 0.25 * want);
  const double norm_gpu = ops::clip_by_global_norm(gpu(), gpu_grads, 0.25 * want);
  EXPECT_NEAR(norm_gpu, norm_cpu, 1e-12 * norm_cpu);
  for (size_t i = 0; i < cpu_grads.size(); ++i) {
    EXPECT_LT(relative_error(on_cpu(gpu_grads[i]), cpu_grads[i]), 1e-6) << "grads[" << i << "]";
  }
  EXPECT_NEAR(ops::global_norm(gpu(), gpu_grads), 0.25 * want, 1e-6 * want);
}

TEST(CudaOptim, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Tensor p16 = Tensor::zeros({4}, DType::BF16, cuda);
  expect_error([&] { ops::adamw_step(gpu(), p16, p16, p16, p16, ops::AdamWParams{}); },
               {"adamw_step", "param", "f32", "bf16"});
  Tensor p = Tensor::zeros({4}, DType::F32, cuda);
  Tensor host = Tensor::zeros({4}, DType::F32);
  expect_error([&] { ops::adamw_step(gpu(), p, p, p, host, ops::AdamWParams{}); },
               {"adamw_step", "grad", "stream's device cuda:0", "on cpu"});
  expect_error(
      [&] {
        ops::global_norm(gpu(), {p, host});
      },
      {"global_norm", "tensors[1]", "stream's device cuda:0", "on cpu"});
  expect_error([&] { ops::sum_of_squares(gpu(), Tensor::zeros({4}, DType::F64, cuda)); },
               {"sum_of_squares", "x", "f32", "f64"});
}

// The state of a list of f32 tensors on the CPU, with non-zero moments (as after earlier steps) and mixed decays.
struct MultiLists {
  std::vector<Tensor> p, m, v;
  std::vector<double> decay;
};

MultiLists make_lists(const std::vector<Shape>& shapes, Rng& rng) {
  MultiLists l;
  for (size_t i = 0; i < shapes.size(); ++i) {
    l.p.push_back(random_tensor(shapes[i], DType::F32, rng));
    l.m.push_back(random_tensor(shapes[i], DType::F32, rng, 0.01));
    Tensor v = random_tensor(shapes[i], DType::F32, rng, 0.1);
    for (int64_t k = 0; k < v.numel(); ++k) v.data<float>()[k] = v.data<float>()[k] * v.data<float>()[k];  // >= 0
    l.v.push_back(v);
    l.decay.push_back(i % 3 == 0 ? 0.1 : (i % 3 == 1 ? 0.0 : 0.013));
  }
  return l;
}

std::vector<Tensor> gpu_copies(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(on_gpu(t));
  return out;
}

// Runs `steps` AdamW steps on three copies of one state: adamw_step_multi on the GPU (with `copy_dtypes[i]`
// compute copies: BF16, F32, or F64 meaning "the param itself", I32 meaning none), adamw_step per tensor on the GPU,
// and adamw_step per tensor on the CPU; then compares all three bitwise, and each copy with a cast of the param.
void check_multi_against_single(const std::vector<Shape>& shapes, const std::vector<DType>& copy_dtypes, int steps,
                                double beta1) {
  Rng rng(91);
  MultiLists cpu = make_lists(shapes, rng);  // the CPU run works on these tensors, the GPU runs on copies made now
  MultiLists multi{gpu_copies(cpu.p), gpu_copies(cpu.m), gpu_copies(cpu.v), cpu.decay};
  MultiLists single{gpu_copies(cpu.p), gpu_copies(cpu.m), gpu_copies(cpu.v), cpu.decay};
  std::vector<Tensor> copies(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    if (copy_dtypes[i] == DType::BF16 || copy_dtypes[i] == DType::F32) {
      copies[i] = Tensor::zeros(shapes[i], copy_dtypes[i], Device::cuda(0));
    } else if (copy_dtypes[i] == DType::F64) {
      copies[i] = multi.p[i];  // the param is its own compute weight: no copy
    }
  }
  ops::AdamWParams hyper{3e-4, beta1, 0.95, 1e-8, /*ignored by the multi op:*/ 0.7, 1};
  for (int64_t step = 1; step <= steps; ++step) {
    hyper.step = step;
    std::vector<Tensor> grads;
    for (const Shape& shape : shapes) grads.push_back(random_tensor(shape, DType::F32, rng, 1e-2));
    const std::vector<Tensor> grads_gpu = gpu_copies(grads);
    ops::adamw_step_multi(gpu(), multi.p, multi.m, multi.v, grads_gpu, copies, multi.decay, hyper);
    for (size_t i = 0; i < shapes.size(); ++i) {
      ops::AdamWParams p = hyper;
      p.weight_decay = cpu.decay[i];
      ops::adamw_step(gpu(), single.p[i], single.m[i], single.v[i], grads_gpu[i], p);
      ops::adamw_step(Stream::cpu(), cpu.p[i], cpu.m[i], cpu.v[i], grads[i], p);
    }
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i << " of " << shapes.size() << " (" << shapes[i].size() << "-d, "
                                      << cpu.p[i].numel() << " elements, weight decay " << cpu.decay[i] << ")");
    const Tensor p = on_cpu(multi.p[i]), m = on_cpu(multi.m[i]), v = on_cpu(multi.v[i]);
    expect_same_bits(p, on_cpu(single.p[i]), "param: multi vs per-tensor CUDA");
    expect_same_bits(m, on_cpu(single.m[i]), "exp_avg: multi vs per-tensor CUDA");
    expect_same_bits(v, on_cpu(single.v[i]), "exp_avg_sq: multi vs per-tensor CUDA");
    expect_same_bits(p, cpu.p[i], "param: multi vs CPU");
    expect_same_bits(m, cpu.m[i], "exp_avg: multi vs CPU");
    expect_same_bits(v, cpu.v[i], "exp_avg_sq: multi vs CPU");
    if (copy_dtypes[i] == DType::BF16 || copy_dtypes[i] == DType::F32) {
      // The copy holds the updated param as ops::cast (core/dtype.h's rounding) writes it.
      EXPECT_TRUE(same_bytes(copies[i], p.to(copy_dtypes[i])))
          << "compute copy (" << dtype_name(copy_dtypes[i]) << ") differs from the cast of the updated param";
    }
  }
}

TEST(CudaAdamWMulti, MatchesPerTensorCudaAndCpuBitwiseWithCopies) {
  MT_REQUIRE_GPU();
  // Chunk edges (kAdamWMultiChunk = 8192 elements per block): a tensor of exactly one chunk, one element past it, a
  // many-chunk tensor, an empty one and tiny ones between them; copies of every kind.
  const std::vector<Shape> shapes{{8192}, {8193}, {1}, {0}, {100003}, {64, 33}, {7}, {3, 4, 5}};
  const std::vector<DType> copies{DType::BF16, DType::BF16, DType::I32, DType::BF16,
                                  DType::BF16, DType::F32,  DType::F64, DType::I32};
  for (double beta1 : {0.9, 0.3}) {  // both branches of lerp
    SCOPED_TRACE(::testing::Message() << "beta1 " << beta1);
    check_multi_against_single(shapes, copies, 4, beta1);
  }
}

TEST(CudaAdamWMulti, ManySmallTensorsMatchPerTensorBitwise) {
  MT_REQUIRE_GPU();
  // 300 tensors of assorted sizes: the block -> tensor binary search over a long table, with many tensors sharing
  // no chunk and some spanning several.
  std::vector<Shape> shapes;
  std::vector<DType> copies;
  for (int i = 0; i < 300; ++i) {
    shapes.push_back({static_cast<int64_t>((i * 7919) % 20000)});
    copies.push_back(i % 2 == 0 ? DType::BF16 : DType::I32);
  }
  check_multi_against_single(shapes, copies, 2, 0.9);
}

// A copy of `t` on the GPU whose base sits one element past a 256-byte-aligned allocation: off 16 bytes (f32) or 8
// (bf16), so its chunks take the element-by-element path instead of four elements per 16-byte load.
Tensor misaligned_gpu_copy(const Tensor& t) {
  Tensor buffer = Tensor::zeros({t.numel() + 1}, t.dtype(), Device::cuda(0));
  Tensor view = buffer.slice(1, t.numel() + 1).view(t.shape());
  view.copy_from(t.device().is_cpu() ? on_gpu(t) : t);
  return view;
}

// Three AdamW steps of adamw_step_multi on the GPU (bf16 copies; tensor i on misaligned memory where misaligned[i];
// the moments in `moments`, f32 or bf16) against adamw_step on the CPU, with `grad_scale`: compared bitwise.
void check_multi_against_cpu(const std::vector<Shape>& shapes, const std::vector<bool>& misaligned, double grad_scale,
                             uint64_t seed, DType moments = DType::F32) {
  Rng rng(seed);
  MultiLists cpu = make_lists(shapes, rng);
  for (size_t i = 0; i < shapes.size(); ++i) {
    cpu.m[i] = cpu.m[i].to(moments);
    cpu.v[i] = cpu.v[i].to(moments);
  }
  const auto to_gpu = [&](const Tensor& t, size_t i) { return misaligned[i] ? misaligned_gpu_copy(t) : on_gpu(t); };
  std::vector<Tensor> p, m, v, copies;
  for (size_t i = 0; i < shapes.size(); ++i) {
    p.push_back(to_gpu(cpu.p[i], i));
    m.push_back(to_gpu(cpu.m[i], i));
    v.push_back(to_gpu(cpu.v[i], i));
    copies.push_back(to_gpu(Tensor::zeros(shapes[i], DType::BF16), i));
  }
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<Tensor> grads, grads_gpu;
    for (const Shape& shape : shapes) grads.push_back(random_tensor(shape, DType::F32, rng, 1.0));
    for (size_t i = 0; i < shapes.size(); ++i) grads_gpu.push_back(to_gpu(grads[i], i));
    const ops::AdamWParams hyper{3e-4, 0.9, 0.95, 1e-8, 0.0, step, grad_scale};
    ops::adamw_step_multi(gpu(), p, m, v, grads_gpu, copies, cpu.decay, hyper);
    for (size_t i = 0; i < shapes.size(); ++i) {
      ops::AdamWParams one = hyper;
      one.weight_decay = cpu.decay[i];
      ops::adamw_step(Stream::cpu(), cpu.p[i], cpu.m[i], cpu.v[i], grads[i], one);
    }
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "tensor " << i << (misaligned[i] ? " (misaligned)" : ""));
    expect_same_bits(on_cpu(p[i]), cpu.p[i], "param: multi vs CPU");
    EXPECT_TRUE(same_bytes(on_cpu(m[i]), cpu.m[i])) << "exp_avg: multi vs CPU";
    EXPECT_TRUE(same_bytes(on_cpu(v[i]), cpu.v[i])) << "exp_avg_sq: multi vs CPU";
    EXPECT_TRUE(same_bytes(on_cpu(copies[i]), cpu.p[i].to(DType::BF16))) << "bf16 copy differs from the cast";
  }
}

TEST(CudaAdamWMulti, MisalignedTensorsMatchCpuBitwise) {
  MT_REQUIRE_GPU();
  check_multi_against_cpu({{8192 * 3}, {4096}, {33, 64}}, {true, true, true}, 1.0, 93);
}

// The clip folded into the update (grad_scale): aligned chunks (four at a time), a ragged tail, a misaligned tensor.
TEST(CudaAdamWMulti, GradScaleMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  check_multi_against_cpu({{8192 * 2 + 3}, {64, 33}, {5}}, {false, false, true}, ops::clip_coefficient(23.9, 1.0), 94);
}

// Moments kept in bf16 (optim.state_dtype = bf16): four at a time on 8-byte loads, a ragged tail, misaligned
// tensors (bf16 moments off by 2 bytes), the clip folded in; the CPU's bytes.
TEST(CudaAdamWMulti, Bf16MomentsMatchCpuBitwise) {
  MT_REQUIRE_GPU();
  check_multi_against_cpu({{8192 * 2 + 3}, {64, 33}, {5}, {4096}}, {false, false, true, true}, 1.0, 95, DType::BF16);
  check_multi_against_cpu({{8192 * 3}, {7}}, {false, true}, ops::clip_coefficient(5.3, 1.0), 96, DType::BF16);
}

TEST(CudaOptim, AdamWWithBf16MomentsMatchesCpuBitwise) {
  MT_REQUIRE_GPU();
  Rng rng(97);
  const int64_t n = 10007;
  Tensor p_cpu = random_tensor({n}, DType::F32, rng);
  Tensor m_cpu = Tensor::zeros({n}, DType::BF16), v_cpu = Tensor::zeros({n}, DType::BF16);
  Tensor p_gpu = on_gpu(p_cpu), m_gpu = on_gpu(m_cpu), v_gpu = on_gpu(v_cpu);
  for (int64_t step = 1; step <= 4; ++step) {
    const Tensor grad = random_tensor({n}, DType::F32, rng, 1e-2);
    const ops::AdamWParams params{3e-4, 0.9, 0.95, 1e-8, 0.1, step};
    ops::adamw_step(Stream::cpu(), p_cpu, m_cpu, v_cpu, grad, params);
    ops::adamw_step(gpu(), p_gpu, m_gpu, v_gpu, on_gpu(grad), params);
  }
  expect_same_bits(on_cpu(p_gpu), p_cpu, "param");
  EXPECT_TRUE(same_bytes(on_cpu(m_gpu), m_cpu)) << "exp_avg";
  EXPECT_TRUE(same_bytes(on_cpu(v_gpu), v_cpu)) << "exp_avg_sq";
}

TEST(CudaAdamWMulti, RepeatedRunsGiveIdenticalBitsAndReuseTheTable) {
  MT_REQUIRE_GPU();
  Rng rng(92);
  const std::vector<Shape> shapes{{5000}, {70000}, {16}};
  const MultiLists start = make_lists(shapes, rng);
  std::vector<Tensor> grads;
  for (const Shape& shape : shapes) grads.push_back(on_gpu(random_tensor(shape, DType::F32, rng, 1e-2)));
  std::vector<Tensor> results[2];
  std::vector<Tensor> copy_results[2];
#if MOETRAIN_HAS_CUDA
  const int64_t built_before = ops::cuda::adamw_multi_tables_built();
#endif
  for (int run = 0; run < 2; ++run) {
    MultiLists s{gpu_copies(start.p), gpu_copies(start.m), gpu_copies(start.v), start.decay};
    std::vector<Tensor> copies{Tensor::zeros(shapes[0], DType::BF16, Device::cuda(0)), Tensor(),
                               Tensor::zeros(shapes[2], DType::BF16, Device::cuda(0))};
    for (int64_t step = 1; step <= 3; ++step) {
      ops::adamw_step_multi(gpu(), s.p, s.m, s.v, grads, copies, s.decay, {1e-3, 0.9, 0.95, 1e-8, 0.0, step});
    }
#if MOETRAIN_HAS_CUDA
    // Within a run the list stays the same: one table for its three steps (the second run's params are new
    // tensors, as the first run's are still held, so it builds its own).
    EXPECT_EQ(ops::cuda::adamw_multi_tables_built(), built_before + run + 1) << "run " << run;
#endif
    results[run] = s.p;
    copy_results[run] = copies;
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    EXPECT_TRUE(same_bytes(results[0][i], results[1][i])) << "param " << i << " differs between two runs";
    if (copy_results[0][i].defined()) {
      EXPECT_TRUE(same_bytes(copy_results[0][i], copy_results[1][i])) << "copy " << i << " differs between runs";
    }
  }
}

TEST(CudaAdamWMulti, RejectsDtypesWithoutACudaKernelAndMixedDevices) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Tensor p = Tensor::zeros({4}, DType::F32, cuda), m = Tensor::zeros({4}, DType::F32, cuda);
  Tensor v = Tensor::zeros({4}, DType::F32, cuda), g = Tensor::zeros({4}, DType::F32, cuda);
  const ops::AdamWParams hyper;
  Tensor p16 = Tensor::zeros({4}, DType::BF16, cuda);
  expect_error([&] { ops::adamw_step_multi(gpu(), {p16}, {p16}, {p16}, {p16}, {}, {0.0}, hyper); },
               {"adamw_step_multi", "params[0]", "f32", "bf16"});
  expect_error(
      [&] { ops::adamw_step_multi(gpu(), {p}, {m}, {v}, {g}, {Tensor::zeros({4}, DType::F64, cuda)}, {0.0}, hyper); },
      {"adamw_step_multi", "compute_copies[0]", "bf16 or f32 (CUDA)", "f64"});
  expect_error(
      [&] { ops::adamw_step_multi(gpu(), {p}, {m}, {v}, {g}, {Tensor::zeros({4}, DType::BF16)}, {0.0}, hyper); },
      {"adamw_step_multi", "compute_copies[0]", "stream's device cuda:0", "on cpu"});
  expect_error([&] { ops::adamw_step_multi(gpu(), {p}, {m}, {v}, {Tensor::zeros({4}, DType::F32)}, {}, {0.0}, hyper); },
               {"adamw_step_multi", "grads[0]", "stream's device cuda:0", "on cpu"});
}

#if MOETRAIN_HAS_CUDA
// How much of an AdamW step over fp32 masters hides behind compute-bound GEMMs on the other stream: the question
// behind running a step's updates, part by part, beside the next step's forward (docs/gpu_notes.md, seventeenth
// session). 1.5B parameters in six parts (AdamW with a bf16 compute copy: ~45 GB moved) against 24 bf16 GEMMs of
// 8192 x 16384 x 2048 (~13 TFLOP), each alone, then the parts on the communication stream, each queued before four of
// the GEMMs on the compute stream. On an H200 (seventeenth session) none of it hides: gemms 15.53 ms, AdamW 11.13 ms
// (4.0 TB/s), both 26.94 ms, because the GEMMs' grids fill every SM and the AdamW blocks run only between them.
TEST(CudaAdamWBench, DISABLED_BesideGemms) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  Stream& compute = gpu();
  Stream& side = communication_stream(cuda);
  ASSERT_NE(side.native(), compute.native()) << "the runtime registered no communication stream";
  constexpr int kParts = 6, kGemmsPerPart = 4;
  constexpr int64_t kPartElements = 250'000'000;
  std::vector<Tensor> p, m, v, g, copies;
  std::vector<double> decay;
  for (int i = 0; i < kParts; ++i) {
    p.push_back(Tensor::zeros({kPartElements}, DType::F32, cuda));
    m.push_back(Tensor::zeros({kPartElements}, DType::F32, cuda));
    v.push_back(Tensor::zeros({kPartElements}, DType::F32, cuda));
    g.push_back(Tensor::zeros({kPartElements}, DType::F32, cuda));
    copies.push_back(Tensor::zeros({kPartElements}, DType::BF16, cuda));
    decay.push_back(0.1);
  }
  const Tensor x = Tensor::zeros({8192, 2048}, DType::BF16, cuda), w = Tensor::zeros({16384, 2048}, DType::BF16, cuda);
  Tensor y = Tensor::empty({8192, 16384}, DType::BF16, cuda);
  int64_t step = 0;
  const auto update = [&](Stream& stream, int part) {
    ops::adamw_step_multi(stream, {p[part]}, {m[part]}, {v[part]}, {g[part]}, {copies[part]}, {decay[part]},
                          {1e-4, 0.9, 0.95, 1e-8, 0.0, ++step});
  };
  const auto gemms = [&](int count) {
    for (int i = 0; i < count; ++i) ops::linear_forward(compute, y, x, w);
  };
  const auto time_ms = [&](const std::function<void()>& work) {
    auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(compute));
    work();  // warm-up (tables, cuBLASLt's heuristic)
    stream_wait(compute, side);
    cudaEvent_t start, stop;
    MT_CUDA_CHECK(cudaEventCreate(&start));
    MT_CUDA_CHECK(cudaEventCreate(&stop));
    MT_CUDA_CHECK(cudaEventRecord(start, stream));
    stream_wait(side, compute);
    work();
    stream_wait(compute, side);
    MT_CUDA_CHECK(cudaEventRecord(stop, stream));
    MT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    MT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    MT_CUDA_CHECK(cudaEventDestroy(start));
    MT_CUDA_CHECK(cudaEventDestroy(stop));
    return static_cast<double>(ms);
  };
  const double gemm_ms = time_ms([&] { gemms(kParts * kGemmsPerPart); });
  const double adamw_ms = time_ms([&] {
    for (int part = 0; part < kParts; ++part) update(compute, part);
  });
  const double both_ms = time_ms([&] {
    for (int part = 0; part < kParts; ++part) {
      update(side, part);
      gemms(kGemmsPerPart);
    }
  });
  std::printf(
      "[adamw beside gemms] gemms alone %.2f ms, adamw alone %.2f ms (%.0f GB/s), both %.2f ms: %.2f ms of "
      "the adamw hidden (%.0f%%)\n",
      gemm_ms, adamw_ms, kParts * kPartElements * 30.0 / (adamw_ms * 1e6), both_ms, gemm_ms + adamw_ms - both_ms,
      100.0 * (gemm_ms + adamw_ms - both_ms) / adamw_ms);
}
#endif

}  // namespace
}  // namespace moetrain
