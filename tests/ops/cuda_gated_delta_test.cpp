// CUDA tests for ops/gated_delta: every op's forward and backward on the GPU against the CPU reference (f32 from the
// same, bf16-rounded where the GPU reads bf16, inputs), on packed documents with single-token ones and ones crossing
// 64-token chunk boundaries; the rule (its chunked kernels) with Hv = 2 Hk, odd small head dims and the released
// ones (128), strong decays, and against the sequential CUDA scan on longer documents; bitwise repeatability; the
// CUDA-only refusals.
#include "ops/gated_delta.h"

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

#if MOETRAIN_HAS_CUDA
#include "ops/cuda/gated_delta.h"
#endif

namespace moetrain::ops {
namespace {

using testing::gpu;
using testing::host_f32;
using testing::on_gpu;
using testing::random_tensor;
using testing::relative_error;

Tensor cu_of(const std::vector<int32_t>& cu) { return Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}); }

// The host f32 value an input has on the GPU in `dtype` (bf16 rounds), and its device copy.
struct Input {
  Tensor host, device;
};

Input input(const Tensor& f32, DType dtype) {
  const Tensor host = dtype == DType::BF16 ? testing::rounded_to_bf16(f32) : f32;
  return {host, on_gpu(host.to(dtype))};
}

// Tolerances: f32 differs from the CPU only in summation order (1e-5 relative covers sums of a few hundred terms);
// bf16 outputs carry their own rounding (2^-9 relative) on top.
double tolerance(DType dtype) { return dtype == DType::BF16 ? 1e-2 : 1e-5; }
// The rule's chunked kernels reassociate the recurrence (the WY inverse by forward substitution, the chunk states as
// sums of 64-term products, dg as the reverse cumsum of row-minus-column sums): 1e-4 relative in f32. bf16 as above,
// against the CPU fed the same bf16-rounded inputs.
double rule_tolerance(DType dtype) { return dtype == DType::BF16 ? 1e-2 : 1e-4; }

struct RuleCase {
  std::vector<int32_t> cu;
  int64_t hk, hv, dk, dv;
  bool strong_decay = false;  // every 7th g = -4 - 16 |x|: exp(cumulative g) underflows to 0 in a chunk
};

// The rule's inputs as check_rule and the sequential cross-check draw them: q, k L2-normalised, g <= -0.01 (the
// gates' log-decay), beta in (0, 1).
struct RuleInputs {
  Input q, k, v, dout;
  Tensor g, beta, cu;
  float scale;
};

RuleInputs rule_inputs(const RuleCase& c, DType dtype, uint64_t seed) {
  Rng rng(seed);
  const int64_t T = c.cu.back();
  Tensor qr = random_tensor({T, c.hk, c.dk}, DType::F32, rng), kr = random_tensor({T, c.hk, c.dk}, DType::F32, rng);
  Tensor qn = Tensor::empty(qr.shape(), DType::F32), kn = Tensor::empty(kr.shape(), DType::F32);
  l2norm_forward(Stream::cpu(), qn, qr, 1e-6f);
  l2norm_forward(Stream::cpu(), kn, kr, 1e-6f);
  RuleInputs in{input(qn, dtype),
                input(kn, dtype),
                input(random_tensor({T, c.hv, c.dv}, DType::F32, rng), dtype),
                input(random_tensor({T, c.hv, c.dv}, DType::F32, rng), dtype),
                random_tensor({T, c.hv}, DType::F32, rng),
                random_tensor({T, c.hv}, DType::F32, rng),
                cu_of(c.cu),
                1.0f / std::sqrt(float(c.dk))};
  // g = -0.01 - 0.2 |x| as the gates give them (every 7th -4 - 16 |x| with strong_decay), beta in (0, 1); f32 on the
  // GPU.
  for (int64_t i = 0; i < in.g.numel(); ++i) {
    const float x = std::abs(in.g.data<float>()[i]);
    in.g.data<float>()[i] = c.strong_decay && i % 7 == 3 ? -4.0f - 16.0f * x : -0.01f - 0.2f * x;
    in.beta.data<float>()[i] = 1.0f / (1.0f + std::exp(-in.beta.data<float>()[i]));
  }
  return in;
}

void check_rule(const RuleCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(fmt::format("dtype {} dk {} dv {} Hk {} Hv {} strong decay {}", dtype_name(dtype), c.dk, c.dv, c.hk,
                           c.hv, c.strong_decay));
  const RuleInputs in = rule_inputs(c, dtype, seed);
  const int64_t T = c.cu.back();
  const Tensor& g = in.g;
  const Tensor& beta = in.beta;
  Tensor out = Tensor::empty({T, c.hv, c.dv}, DType::F32);
  gated_delta_rule_forward(Stream::cpu(), out, in.q.host, in.k.host, in.v.host, g, beta, in.cu, in.scale);
  const Shape qshape = in.q.host.shape();
  std::vector<Tensor> want = {Tensor::empty(qshape, DType::F32), Tensor::empty(qshape, DType::F32),
                              Tensor::empty(out.shape(), DType::F32), Tensor::empty(g.shape(), DType::F32),
                              Tensor::empty(g.shape(), DType::F32)};
  gated_delta_rule_backward(Stream::cpu(), want[0], want[1], want[2], want[3], want[4], in.dout.host, in.q.host,
                            in.k.host, in.v.host, g, beta, in.cu, in.scale);

  const Tensor gd = on_gpu(g), bd = on_gpu(beta), cud = on_gpu(in.cu);
  Tensor out_d = Tensor::empty(out.shape(), dtype, Device::cuda(0));
  auto forward = [&] {
    gated_delta_rule_forward(gpu(), out_d, in.q.device, in.k.device, in.v.device, gd, bd, cud, in.scale);
  };
  forward();
  EXPECT_LT(relative_error(host_f32(out_d), out), rule_tolerance(dtype)) << "out";
  std::vector<Tensor> got = {
      Tensor::empty(qshape, dtype, Device::cuda(0)), Tensor::empty(qshape, dtype, Device::cuda(0)),
      Tensor::empty(out.shape(), dtype, Device::cuda(0)), Tensor::empty(g.shape(), DType::F32, Device::cuda(0)),
      Tensor::empty(g.shape(), DType::F32, Device::cuda(0))};
  auto backward = [&] {
    gated_delta_rule_backward(gpu(), got[0], got[1], got[2], got[3], got[4], in.dout.device, in.q.device, in.k.device,
                              in.v.device, gd, bd, cud, in.scale);
  };
  backward();
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LT(relative_error(host_f32(got[i]), want[i]), rule_tolerance(dtype)) << names[i];
  // Deterministic: a second run of each pass gives the same bytes.
  const Tensor first_out = out_d.to(Device::cpu());
  std::vector<Tensor> first;
  for (const Tensor& t : got) first.push_back(t.to(Device::cpu()));
  forward();
  EXPECT_TRUE(testing::same_bytes(first_out, out_d)) << "out";
  backward();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(testing::same_bytes(first[i], got[i])) << names[i];
  // A backward from the forward's saved intermediates gives the same bytes as one that recomputes them, and leaves
  // them as they were (a second backward from them gives the same bytes again).
  GatedDeltaSaved saved;
  gated_delta_rule_forward(gpu(), out_d, in.q.device, in.k.device, in.v.device, gd, bd, cud, in.scale, &saved);
  EXPECT_TRUE(testing::same_bytes(first_out, out_d)) << "out, saving";
  EXPECT_EQ(saved.tensors.size(), 5u);
  for (int run = 0; run < 2; ++run) {
    gated_delta_rule_backward(gpu(), got[0], got[1], got[2], got[3], got[4], in.dout.device, in.q.device, in.k.device,
                              in.v.device, gd, bd, cud, in.scale, &saved);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(testing::same_bytes(first[i], got[i])) << names[i] << " from the saved forward, run " << run;
    }
  }
}

// Documents of 1, 63, 64, 65, 130, 200, 1 and 7 tokens: chunks clipped at a document's end, chunk boundaries inside
// documents (65, 130, 200) and at them (64), single-token documents between longer ones.
const std::vector<int32_t> kPackedDocs = {0, 1, 64, 128, 193, 323, 523, 524, 531};

TEST(CudaGatedDelta, RuleMatchesCpuOnPackedDocuments) {
  MT_REQUIRE_GPU();
  // Hv = 2 Hk, dk = 16 and dv = 32: a value-column tile of the state passes holds all of v.
  const RuleCase small{kPackedDocs, 2, 4, 16, 32};
  for (DType dtype : {DType::F32, DType::BF16}) check_rule(small, dtype, 1);
}

TEST(CudaGatedDelta, SavedIntermediatesOfAnotherCallAreRefused) {
  MT_REQUIRE_GPU();
  // A backward given what a forward of 90 tokens saved, for a call of 70 (the same number of chunk slots, so the chunk
  // table fits), names the first tensor that does not fit, and writes nothing.
  const RuleCase small{{0, 5, 70}, 1, 2, 16, 32}, other{{0, 5, 90}, 1, 2, 16, 32};
  const RuleInputs in = rule_inputs(small, DType::F32, 9), in_other = rule_inputs(other, DType::F32, 9);
  GatedDeltaSaved saved;
  Tensor out_other = Tensor::empty(in_other.v.device.shape(), DType::F32, Device::cuda(0));
  gated_delta_rule_forward(gpu(), out_other, in_other.q.device, in_other.k.device, in_other.v.device,
                           on_gpu(in_other.g), on_gpu(in_other.beta), on_gpu(in_other.cu), in_other.scale, &saved);
  const Shape qshape = in.q.host.shape(), vshape = in.v.host.shape(), gshape = in.g.shape();
  Tensor dq = Tensor::zeros(qshape, DType::F32, Device::cuda(0)),
         dk = Tensor::zeros(qshape, DType::F32, Device::cuda(0));
  Tensor dv = Tensor::zeros(vshape, DType::F32, Device::cuda(0));
  Tensor dg = Tensor::zeros(gshape, DType::F32, Device::cuda(0)),
         dbeta = Tensor::zeros(gshape, DType::F32, Device::cuda(0));
  testing::expect_error(
      [&] {
        gated_delta_rule_backward(gpu(), dq, dk, dv, dg, dbeta, in.dout.device, in.q.device, in.k.device, in.v.device,
                                  on_gpu(in.g), on_gpu(in.beta), on_gpu(in.cu), in.scale, &saved);
      },
      {"gated_delta_rule_backward (CUDA): the saved w is f32[90, 2, 16]", "expected f32 [70, 2, 16]",
       "saved by another call?"});
  EXPECT_TRUE(testing::same_bytes(Tensor::zeros(vshape, DType::F32), dv)) << "dv was written";
}

TEST(CudaGatedDelta, RuleMatchesCpuAtOddHeadDims) {
  MT_REQUIRE_GPU();
  // dk = 12 and dv = 40: neither a multiple of the 16-wide k-steps nor of the 32 value columns of a state tile.
  const RuleCase odd{{0, 1, 66, 130, 131, 200}, 1, 3, 12, 40};
  for (DType dtype : {DType::F32, DType::BF16}) check_rule(odd, dtype, 5);
}

TEST(CudaGatedDelta, RuleMatchesCpuAtReleasedHeadDims) {
  MT_REQUIRE_GPU();
  const RuleCase released{kPackedDocs, 1, 2, 128, 128};
  for (DType dtype : {DType::F32, DType::BF16}) check_rule(released, dtype, 2);
}

TEST(CudaGatedDelta, RuleMatchesCpuUnderStrongDecay) {
  MT_REQUIRE_GPU();
  // Every 7th g <= -4 (mean -17): a chunk's cumulative decay underflows exp to 0 (G = 0), which the chunked form must
  // survive.
  RuleCase strong{kPackedDocs, 2, 4, 32, 32};
  strong.strong_decay = true;
  for (DType dtype : {DType::F32, DType::BF16}) check_rule(strong, dtype, 3);
}

#if MOETRAIN_HAS_CUDA
TEST(CudaGatedDelta, ChunkedRuleMatchesTheSequentialScan) {
  MT_REQUIRE_GPU();
  // Documents of 1000, 2100 and 1 tokens at the released head dims with Hv = 2 Hk: dozens of chunks carry the state,
  // too long for the CPU reference in a test; the sequential CUDA scan (f32, the recurrence token by token) is the
  // reference. Tolerance as against the CPU: the two sum in different orders.
  const RuleCase c{{0, 1000, 3100, 3101}, 2, 4, 128, 128};
  const RuleInputs in = rule_inputs(c, DType::F32, 4);
  const Tensor gd = on_gpu(in.g), bd = on_gpu(in.beta), cud = on_gpu(in.cu);
  const Device dev = Device::cuda(0);
  const Shape qshape = in.q.host.shape(), vshape = in.v.host.shape(), gshape = in.g.shape();
  auto outputs = [&] {
    return std::vector<Tensor>{Tensor::empty(vshape, DType::F32, dev), Tensor::empty(qshape, DType::F32, dev),
                               Tensor::empty(qshape, DType::F32, dev), Tensor::empty(vshape, DType::F32, dev),
                               Tensor::empty(gshape, DType::F32, dev), Tensor::empty(gshape, DType::F32, dev)};
  };
  std::vector<Tensor> chunked = outputs(), sequential = outputs();
  gated_delta_rule_forward(gpu(), chunked[0], in.q.device, in.k.device, in.v.device, gd, bd, cud, in.scale);
  gated_delta_rule_backward(gpu(), chunked[1], chunked[2], chunked[3], chunked[4], chunked[5], in.dout.device,
                            in.q.device, in.k.device, in.v.device, gd, bd, cud, in.scale);
  cuda::gated_delta_rule_sequential_forward(gpu(), sequential[0], in.q.device, in.k.device, in.v.device, gd, bd, cud,
                                            in.scale);
  cuda::gated_delta_rule_sequential_backward(gpu(), sequential[1], sequential[2], sequential[3], sequential[4],
                                             sequential[5], in.dout.device, in.q.device, in.k.device, in.v.device, gd,
                                             bd, cud, in.scale);
  const char* names[] = {"out", "dq", "dk", "dv", "dg", "dbeta"};
  for (size_t i = 0; i < chunked.size(); ++i)
    EXPECT_LT(relative_error(host_f32(chunked[i]), host_f32(sequential[i])), rule_tolerance(DType::F32)) << names[i];
}
#endif

TEST(CudaGatedDelta, ConvMatchesCpu) {
  MT_REQUIRE_GPU();
  const std::vector<int32_t> docs = {0, 1, 3, 140, 141, 300};  // 1, 2 (< K), 137 (across row chunks), 1, 159 tokens
  const int64_t T = 300, C = 40, K = 4;
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (DType wtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(fmt::format("x {} w {}", dtype_name(dtype), dtype_name(wtype)));
      Rng rng(3);
      const Input x = input(random_tensor({T, C}, DType::F32, rng), dtype);
      const Input w = input(random_tensor({C, K}, DType::F32, rng, 0.5), wtype);
      const Input dy = input(random_tensor({T, C}, DType::F32, rng), dtype);
      const Tensor dw0 = random_tensor({C, K}, DType::F32, rng);
      const Tensor cu = cu_of(docs);
      Tensor y = Tensor::empty({T, C}, DType::F32), dx = Tensor::empty({T, C}, DType::F32), dw = dw0.clone();
      causal_conv1d_silu_forward(Stream::cpu(), y, x.host, w.host, cu);
      causal_conv1d_silu_backward(Stream::cpu(), dx, dw, dy.host, x.host, w.host, cu);
      Tensor yd = Tensor::empty({T, C}, dtype, Device::cuda(0)), dxd = Tensor::empty({T, C}, dtype, Device::cuda(0));
      Tensor dwd = on_gpu(dw0);
      const Tensor cud = on_gpu(cu);
      causal_conv1d_silu_forward(gpu(), yd, x.device, w.device, cud);
      causal_conv1d_silu_backward(gpu(), dxd, dwd, dy.device, x.device, w.device, cud);
      EXPECT_LT(relative_error(host_f32(yd), y), tolerance(dtype));
      EXPECT_LT(relative_error(host_f32(dxd), dx), tolerance(dtype));
      EXPECT_LT(relative_error(host_f32(dwd), dw), 1e-5);  // f32 sums of f32 products of the same inputs
    }
  }
}

TEST(CudaGatedDelta, NormsAndGatesMatchCpu) {
  MT_REQUIRE_GPU();
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Rng rng(4);
    const int64_t N = 300, D = 128, H = 6;
    const Input x = input(random_tensor({N, D}, DType::F32, rng), dtype);
    const Input z = input(random_tensor({N, D}, DType::F32, rng), dtype);
    const Input dy = input(random_tensor({N, D}, DType::F32, rng), dtype);
    const Tensor w = random_tensor({D}, DType::F32, rng, 0.5);

    Tensor y = Tensor::empty({N, D}, DType::F32), dx = Tensor::empty({N, D}, DType::F32);
    l2norm_forward(Stream::cpu(), y, x.host, 1e-6f);
    l2norm_backward(Stream::cpu(), dx, dy.host, x.host, 1e-6f);
    Tensor yd = Tensor::empty({N, D}, dtype, Device::cuda(0)), dxd = Tensor::empty({N, D}, dtype, Device::cuda(0));
    l2norm_forward(gpu(), yd, x.device, 1e-6f);
    l2norm_backward(gpu(), dxd, dy.device, x.device, 1e-6f);
    EXPECT_LT(relative_error(host_f32(yd), y), tolerance(dtype)) << "l2norm y";
    EXPECT_LT(relative_error(host_f32(dxd), dx), tolerance(dtype)) << "l2norm dx";

    Tensor rstd = Tensor::empty({N}, DType::F32), dz = Tensor::empty({N, D}, DType::F32);
    Tensor dw = Tensor::zeros({D}, DType::F32);
    gated_rmsnorm_forward(Stream::cpu(), y, rstd, x.host, z.host, w, 1e-6f);
    gated_rmsnorm_backward(Stream::cpu(), dx, dz, dw, dy.host, x.host, z.host, w, rstd, 1e-6f);
    Tensor rstdd = Tensor::empty({N}, DType::F32, Device::cuda(0)), dzd = Tensor::empty({N, D}, dtype, Device::cuda(0));
    Tensor dwd = Tensor::zeros({D}, DType::F32, Device::cuda(0));
    const Tensor wd = on_gpu(w);
    gated_rmsnorm_forward(gpu(), yd, rstdd, x.device, z.device, wd, 1e-6f);
    gated_rmsnorm_backward(gpu(), dxd, dzd, dwd, dy.device, x.device, z.device, wd, rstdd, 1e-6f);
    EXPECT_LT(relative_error(host_f32(yd), y), tolerance(dtype)) << "gated norm y";
    EXPECT_LT(relative_error(host_f32(rstdd), rstd), 1e-5) << "rstd";
    EXPECT_LT(relative_error(host_f32(dxd), dx), tolerance(dtype)) << "gated norm dx";
    EXPECT_LT(relative_error(host_f32(dzd), dz), tolerance(dtype)) << "gated norm dz";
    EXPECT_LT(relative_error(host_f32(dwd), dw), 1e-5) << "gated norm dw";

    const Input a = input(random_tensor({N, H}, DType::F32, rng, 3.0), dtype);
    const Input b = input(random_tensor({N, H}, DType::F32, rng, 3.0), dtype);
    const Tensor A_log = random_tensor({H}, DType::F32, rng), dt_bias = random_tensor({H}, DType::F32, rng);
    const Tensor dg = random_tensor({N, H}, DType::F32, rng), dbeta = random_tensor({N, H}, DType::F32, rng);
    Tensor g = Tensor::empty({N, H}, DType::F32), beta = Tensor::empty({N, H}, DType::F32);
    Tensor da = Tensor::empty({N, H}, DType::F32), db = Tensor::empty({N, H}, DType::F32);
    Tensor dA = Tensor::zeros({H}, DType::F32), dbias = Tensor::zeros({H}, DType::F32);
    gated_delta_gates_forward(Stream::cpu(), g, beta, a.host, b.host, A_log, dt_bias);
    gated_delta_gates_backward(Stream::cpu(), da, db, dA, dbias, dg, dbeta, a.host, b.host, A_log, dt_bias);
    Tensor gd = Tensor::empty({N, H}, DType::F32, Device::cuda(0)),
           betad = Tensor::empty({N, H}, DType::F32, Device::cuda(0));
    Tensor dad = Tensor::empty({N, H}, dtype, Device::cuda(0)), dbd = Tensor::empty({N, H}, dtype, Device::cuda(0));
    Tensor dAd = Tensor::zeros({H}, DType::F32, Device::cuda(0)),
           dbiasd = Tensor::zeros({H}, DType::F32, Device::cuda(0));
    const Tensor Ad = on_gpu(A_log), biasd = on_gpu(dt_bias);
    gated_delta_gates_forward(gpu(), gd, betad, a.device, b.device, Ad, biasd);
    gated_delta_gates_backward(gpu(), dad, dbd, dAd, dbiasd, on_gpu(dg), on_gpu(dbeta), a.device, b.device, Ad, biasd);
    EXPECT_LT(relative_error(host_f32(gd), g), 1e-5) << "g";  // f32 outputs of the same inputs
    EXPECT_LT(relative_error(host_f32(betad), beta), 1e-5) << "beta";
    EXPECT_LT(relative_error(host_f32(dad), da), tolerance(dtype)) << "da";
    EXPECT_LT(relative_error(host_f32(dbd), db), tolerance(dtype)) << "db";
    EXPECT_LT(relative_error(host_f32(dAd), dA), 1e-5) << "dA_log";
    EXPECT_LT(relative_error(host_f32(dbiasd), dbias), 1e-5) << "ddt_bias";
  }
}

TEST(CudaGatedDelta, RefusesWhatTheKernelsCannotTake) {
  MT_REQUIRE_GPU();
  const Tensor cu = on_gpu(cu_of({0, 4}));
  const Tensor q = Tensor::zeros({4, 1, 160}, DType::F32, Device::cuda(0));
  const Tensor v = Tensor::zeros({4, 1, 8}, DType::F32, Device::cuda(0));
  const Tensor g = Tensor::zeros({4, 1}, DType::F32, Device::cuda(0));
  Tensor out = Tensor::zeros({4, 1, 8}, DType::F32, Device::cuda(0));
  testing::expect_error([&] { gated_delta_rule_forward(gpu(), out, q, q, v, g, g, cu, 0.5f); }, "dk <= 128");
  const Tensor q8 = Tensor::zeros({4, 1, 8}, DType::F32, Device::cuda(0));
  const Tensor v160 = Tensor::zeros({4, 1, 160}, DType::F32, Device::cuda(0));
  Tensor out160 = Tensor::zeros({4, 1, 160}, DType::F32, Device::cuda(0));
  testing::expect_error([&] { gated_delta_rule_forward(gpu(), out160, q8, q8, v160, g, g, cu, 0.5f); }, "dv <= 128");
  const Tensor qb = Tensor::zeros({4, 1, 8}, DType::BF16, Device::cuda(0));
  testing::expect_error(
      [&] { gated_delta_rule_forward(gpu(), out, qb, qb, qb, g.to(Device::cpu()).to(DType::F32), g, cu, 0.5f); }, "g");
  const Tensor x = Tensor::zeros({4, 3}, DType::F64, Device::cuda(0));
  Tensor y = Tensor::zeros({4, 3}, DType::F64, Device::cuda(0));
  testing::expect_error([&] { l2norm_forward(gpu(), y, x, 1e-6f); }, "f32 or bf16 (CUDA)");
}

}  // namespace
}  // namespace moetrain::ops
