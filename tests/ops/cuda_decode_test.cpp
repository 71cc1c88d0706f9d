// Tests of generation's CUDA ops against the CPU reference: the decoding attention (f32 and bf16, GQA, windows, the
// latent-attention head dims 192 / 128), the conv step and the gated delta rule's prefill and steps (the sequential
// scan from and into a state).
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/attention.h"
#include "ops/gated_delta.h"
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
using testing::rounded_to_bf16;

TEST(CudaDecode, AttentionMatchesCpu) {
  MT_REQUIRE_GPU();
  struct Case {
    int64_t nh, nkv, hd, hdv;
    int window;
  };
  for (const Case c : {Case{6, 2, 32, 32, 0}, Case{6, 2, 32, 32, 5}, Case{4, 4, 192, 128, 0}}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " hd " + std::to_string(c.hd) + " window " +
                   std::to_string(c.window));
      Rng rng(71);
      const int64_t rows = 3, capacity = 40;
      Tensor q = random_tensor({rows, c.nh, c.hd}, DType::F32, rng);
      Tensor k = random_tensor({rows, capacity, c.nkv, c.hd}, DType::F32, rng);
      Tensor v = random_tensor({rows, capacity, c.nkv, c.hdv}, DType::F32, rng);
      if (dtype == DType::BF16) q = rounded_to_bf16(q), k = rounded_to_bf16(k), v = rounded_to_bf16(v);
      const Tensor lengths = Tensor::from_vector<int32_t>({1, 17, 40}, {rows});
      AttentionParams params;
      params.softmax_scale = 0.2f;
      params.sliding_window = c.window;
      Tensor out = Tensor::empty({rows, c.nh, c.hdv}, DType::F32), lse = Tensor::empty({rows, c.nh}, DType::F32);
      attention_decode_forward(Stream::cpu(), out, lse, q, k, v, lengths, params);
      Tensor out_d = Tensor::empty({rows, c.nh, c.hdv}, dtype, Device::cuda(0));
      Tensor lse_d = Tensor::empty({rows, c.nh}, DType::F32, Device::cuda(0));
      attention_decode_forward(gpu(), out_d, lse_d, on_gpu(q.to(dtype)), on_gpu(k.to(dtype)), on_gpu(v.to(dtype)),
                               lengths, params);
      const double tolerance = dtype == DType::BF16 ? 1e-2 : 1e-5;
      EXPECT_LT(relative_error(host_f32(out_d), out), tolerance) << "out";
      EXPECT_LT(relative_error(host_f32(lse_d), lse), 1e-5) << "lse";
    }
  }
}

TEST(CudaDecode, ConvStepAndRuleStepsMatchCpu) {
  MT_REQUIRE_GPU();
  Rng rng(72);
  const int64_t rows = 2, capacity = 9, C = 20, K = 4, hk = 2, hv = 4, dk = 16, dv = 8;
  // The conv step from each sequence's history of 3 and 9 inputs.
  const Tensor history = random_tensor({rows, capacity, C}, DType::F32, rng),
               w = random_tensor({C, K}, DType::F32, rng);
  const Tensor lengths = Tensor::from_vector<int32_t>({3, 9}, {rows});
  Tensor y = Tensor::empty({rows, C}, DType::F32), y_d = Tensor::empty({rows, C}, DType::F32, Device::cuda(0));
  causal_conv1d_silu_decode(Stream::cpu(), y, history, w, lengths);
  causal_conv1d_silu_decode(gpu(), y_d, on_gpu(history), on_gpu(w), lengths);
  EXPECT_LT(relative_error(host_f32(y_d), y), 1e-6) << "conv";

  // The rule: a prefill of documents of 5 and 11 tokens, then two steps.
  const auto unit_rows = [&](const Shape& shape) {
    Tensor x = random_tensor(shape, DType::F32, rng), n = Tensor::empty(shape, DType::F32);
    l2norm_forward(Stream::cpu(), n, x, 1e-6f);
    return n;
  };
  const auto gates = [&](int64_t tokens, Tensor* g, Tensor* beta) {
    *g = random_tensor({tokens, hv}, DType::F32, rng);
    *beta = random_tensor({tokens, hv}, DType::F32, rng);
    for (int64_t i = 0; i < g->numel(); ++i) {
      g->data<float>()[i] = -0.05f - 0.2f * std::abs(g->data<float>()[i]);
      beta->data<float>()[i] = 1.0f / (1.0f + std::exp(-beta->data<float>()[i]));
    }
  };
  const Tensor q = unit_rows({16, hk, dk}), k = unit_rows({16, hk, dk}),
               v = random_tensor({16, hv, dv}, DType::F32, rng);
  Tensor g, beta;
  gates(16, &g, &beta);
  const Tensor cu = Tensor::from_vector<int32_t>({0, 5, 16}, {3});
  Tensor out = Tensor::empty({16, hv, dv}, DType::F32), state = Tensor::empty({rows, hv, dk, dv}, DType::F32);
  Tensor out_d = Tensor::empty({16, hv, dv}, DType::F32, Device::cuda(0));
  Tensor state_d = Tensor::empty({rows, hv, dk, dv}, DType::F32, Device::cuda(0));
  gated_delta_rule_prefill(Stream::cpu(), out, state, q, k, v, g, beta, cu, 0.25f);
  gated_delta_rule_prefill(gpu(), out_d, state_d, on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(g), on_gpu(beta), on_gpu(cu),
                           0.25f);
  EXPECT_LT(relative_error(host_f32(out_d), out), 1e-5) << "prefill out";
  EXPECT_LT(relative_error(host_f32(state_d), state), 1e-5) << "prefill state";
  for (int step = 0; step < 2; ++step) {
    const Tensor qs = unit_rows({rows, hk, dk}), ks = unit_rows({rows, hk, dk});
    const Tensor vs = random_tensor({rows, hv, dv}, DType::F32, rng);
    Tensor gs, bs;
    gates(rows, &gs, &bs);
    Tensor o = Tensor::empty({rows, hv, dv}, DType::F32),
           o_d = Tensor::empty({rows, hv, dv}, DType::F32, Device::cuda(0));
    gated_delta_rule_decode(Stream::cpu(), o, state, qs, ks, vs, gs, bs, 0.25f);
    gated_delta_rule_decode(gpu(), o_d, state_d, on_gpu(qs), on_gpu(ks), on_gpu(vs), on_gpu(gs), on_gpu(bs), 0.25f);
    EXPECT_LT(relative_error(host_f32(o_d), o), 1e-5) << "step " << step << " out";
    EXPECT_LT(relative_error(host_f32(state_d), state), 1e-5) << "step " << step << " state";
  }
}

}  // namespace
}  // namespace moetrain::ops
