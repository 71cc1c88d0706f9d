// CUDA tests for ops/gated_delta: every op's forward and backward on the GPU against the CPU reference (f32 from the
// same, bf16-rounded where the GPU reads bf16, inputs), on packed documents with single-token ones and ones crossing
// the backward's 64-token checkpoints; the rule with Hv = 2 Hk, value widths that leave threads idle, and the released
// head dims (128); bitwise repeatability; the CUDA-only refusals.
#include "ops/gated_delta.h"

#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

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

// Tolerances: f32 differs from the CPU only in summation order (1e-5 relative covers sums of a few hundred terms and
// the rule's recurrences); bf16 outputs carry their own rounding (2^-9 relative) on top.
double tolerance(DType dtype) { return dtype == DType::BF16 ? 1e-2 : 1e-5; }

struct RuleCase {
  std::vector<int32_t> cu;
  int64_t hk, hv, dk, dv;
};

void check_rule(const RuleCase& c, DType dtype, uint64_t seed) {
  SCOPED_TRACE(fmt::format("dtype {} dk {} dv {} Hk {} Hv {}", dtype_name(dtype), c.dk, c.dv, c.hk, c.hv));
  Rng rng(seed);
  const int64_t T = c.cu.back();
  Tensor qr = random_tensor({T, c.hk, c.dk}, DType::F32, rng), kr = random_tensor({T, c.hk, c.dk}, DType::F32, rng);
  Tensor qn = Tensor::empty(qr.shape(), DType::F32), kn = Tensor::empty(kr.shape(), DType::F32);
  l2norm_forward(Stream::cpu(), qn, qr, 1e-6f);
  l2norm_forward(Stream::cpu(), kn, kr, 1e-6f);
  const Input q = input(qn, dtype), k = input(kn, dtype);
  const Input v = input(random_tensor({T, c.hv, c.dv}, DType::F32, rng), dtype);
  const Input dout = input(random_tensor({T, c.hv, c.dv}, DType::F32, rng), dtype);
  // g in [-0.6, -0.01], beta in (0, 1), as the gates give them (f32 on the GPU).
  Tensor g = random_tensor({T, c.hv}, DType::F32, rng), beta = random_tensor({T, c.hv}, DType::F32, rng);
  for (int64_t i = 0; i < g.numel(); ++i) {
    g.data<float>()[i] = -0.01f - 0.2f * std::abs(g.data<float>()[i]);
    beta.data<float>()[i] = 1.0f / (1.0f + std::exp(-beta.data<float>()[i]));
  }
  const Tensor cu = cu_of(c.cu);
  const float scale = 1.0f / std::sqrt(float(c.dk));

  Tensor out = Tensor::empty({T, c.hv, c.dv}, DType::F32);
  gated_delta_rule_forward(Stream::cpu(), out, q.host, k.host, v.host, g, beta, cu, scale);
  std::vector<Tensor> want = {Tensor::empty(qn.shape(), DType::F32), Tensor::empty(qn.shape(), DType::F32),
                              Tensor::empty(out.shape(), DType::F32), Tensor::empty(g.shape(), DType::F32),
                              Tensor::empty(g.shape(), DType::F32)};
  gated_delta_rule_backward(Stream::cpu(), want[0], want[1], want[2], want[3], want[4], dout.host, q.host, k.host,
                            v.host, g, beta, cu, scale);

  const Tensor gd = on_gpu(g), bd = on_gpu(beta), cud = on_gpu(cu);
  Tensor out_d = Tensor::empty(out.shape(), dtype, Device::cuda(0));
  gated_delta_rule_forward(gpu(), out_d, q.device, k.device, v.device, gd, bd, cud, scale);
  EXPECT_LT(relative_error(host_f32(out_d), out), tolerance(dtype));
  std::vector<Tensor> got = {
      Tensor::empty(qn.shape(), dtype, Device::cuda(0)), Tensor::empty(qn.shape(), dtype, Device::cuda(0)),
      Tensor::empty(out.shape(), dtype, Device::cuda(0)), Tensor::empty(g.shape(), DType::F32, Device::cuda(0)),
      Tensor::empty(g.shape(), DType::F32, Device::cuda(0))};
  auto backward = [&] {
    gated_delta_rule_backward(gpu(), got[0], got[1], got[2], got[3], got[4], dout.device, q.device, k.device, v.device,
                              gd, bd, cud, scale);
  };
  backward();
  const char* names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LT(relative_error(host_f32(got[i]), want[i]), tolerance(dtype)) << names[i];
  // Deterministic: a second run gives the same bytes.
  const std::vector<Tensor> first = {got[0].to(Device::cpu()), got[3].to(Device::cpu())};
  backward();
  EXPECT_TRUE(testing::same_bytes(first[0], got[0]));
  EXPECT_TRUE(testing::same_bytes(first[1], got[3]));
}

TEST(CudaGatedDelta, RuleMatchesCpuOnPackedDocuments) {
  MT_REQUIRE_GPU();
  // Documents of 1, 64, 65 (across a checkpoint), 1 and 69 tokens: chunk boundaries inside documents and at them.
  const RuleCase small{{0, 1, 65, 130, 131, 200}, 2, 4, 16, 12};
  for (DType dtype : {DType::F32, DType::BF16}) check_rule(small, dtype, 1);
}

TEST(CudaGatedDelta, RuleMatchesCpuAtReleasedHeadDims) {
  MT_REQUIRE_GPU();
  const RuleCase released{{0, 70, 71, 150}, 1, 2, 128, 128};
  for (DType dtype : {DType::F32, DType::BF16}) check_rule(released, dtype, 2);
}

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
  const Tensor qb = Tensor::zeros({4, 1, 8}, DType::BF16, Device::cuda(0));
  testing::expect_error(
      [&] { gated_delta_rule_forward(gpu(), out, qb, qb, qb, g.to(Device::cpu()).to(DType::F32), g, cu, 0.5f); }, "g");
  const Tensor x = Tensor::zeros({4, 3}, DType::F64, Device::cuda(0));
  Tensor y = Tensor::zeros({4, 3}, DType::F64, Device::cuda(0));
  testing::expect_error([&] { l2norm_forward(gpu(), y, x, 1e-6f); }, "f32 or bf16 (CUDA)");
}

}  // namespace
}  // namespace moetrain::ops
