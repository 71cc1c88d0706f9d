// Tests for the latent attention block (model/blocks/latent_attention.h) on CUDA against the CPU reference: the same
// weights and inputs, packed documents (one of a single token), with and without the q LoRA, interleaved rope with
// YaRN frequencies; the forward output, the input gradient and every weight gradient in f32 (our kernels), and in
// bf16 compute at DeepSeek-V2-Lite's head shape, where cuDNN's fused attention runs (q/k head dim 192, v 128). Run
// on a GPU; skipped elsewhere.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "model/blocks/latent_attention.h"
#include "ops/rope.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using testing::host_f32;
using testing::on_gpu;

struct Results {
  Tensor out, dx;
  std::vector<Tensor> grads;
};

// The block on `device` in `dtype` over the same f32 weights (a bf16 store keeps fp32 masters and bf16 copies).
Results run(const LatentAttentionOptions& o, const Tensor& x, const Tensor& d_out, const MicroBatch& host_batch,
            Device device, DType dtype) {
  ParameterStore store(block_testing::with_whole_pieces(LatentAttention::param_specs(o, "attn.", 0)), device, dtype);
  block_testing::fill_random(store, 17, 0.08);
  LatentAttention block(o, store, "attn.");
  const MicroBatch batch = host_batch.to(device);
  auto record = block.new_record();
  Results r;
  r.out = host_f32(block.forward(*record, x.to(dtype).to(device), batch));
  r.dx = host_f32(block.backward_input(*record, d_out.to(dtype).to(device)));
  block.backward_weight(*record);
  for (const ParamSpec& spec : store.specs()) r.grads.push_back(host_f32(store.grad(spec.name)));
  return r;
}

MicroBatch packed(const std::vector<int32_t>& cu, int64_t vocab) {
  const int64_t T = cu.back();
  std::vector<int32_t> ids(static_cast<size_t>(T)), targets(static_cast<size_t>(T), -100);
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 7 + 3) % vocab);
  return MicroBatch::packed(Tensor::from_vector(ids, {T}), Tensor::from_vector(targets, {T}),
                            Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}));
}

void expect_close(const Results& got, const Results& want, double tolerance, const std::string& what) {
  EXPECT_LT(testing::relative_error(got.out, want.out), tolerance) << what << ": out";
  EXPECT_LT(testing::relative_error(got.dx, want.dx), tolerance) << what << ": dx";
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i)
    EXPECT_LT(testing::relative_error(got.grads[i], want.grads[i]), tolerance) << what << ": gradient " << i;
}

TEST(CudaLatentAttention, F32MatchesCpu) {
  MT_REQUIRE_GPU();
  ops::YarnOptions yarn;
  yarn.factor = 40;
  yarn.original_max_position_embeddings = 16;
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 0.8;
  for (const int64_t q_lora : {0, 24}) {
    LatentAttentionOptions o;
    o.hidden_size = 64;
    o.num_heads = 4;
    o.q_lora_rank = q_lora;
    o.kv_lora_rank = 32;
    o.qk_nope_head_dim = 32;
    o.qk_rope_head_dim = 16;
    o.v_head_dim = 24;
    o.rope = ops::rope_yarn_params(16, 10000.0, yarn);
    o.rope.interleaved = true;
    o.softmax_scale = ops::yarn_softmax_scale(1.0 / std::sqrt(48.0), yarn);
    const MicroBatch batch = packed({0, 9, 10, 47}, 100);
    Rng rng(5);
    const Tensor x = testing::random_tensor({47, 64}, DType::F32, rng);
    const Tensor d_out = testing::random_tensor({47, 64}, DType::F32, rng);
    const Results want = run(o, x, d_out, batch, Device::cpu(), DType::F32);
    const Results got = run(o, x, d_out, batch, Device::cuda(0), DType::F32);
    // f32 on both sides; the GPU's GEMMs and attention sum in another order: 1e-5 relative.
    expect_close(got, want, 1e-5, "q_lora " + std::to_string(q_lora));
  }
}

TEST(CudaLatentAttention, Bf16AtTheLiteShapeRunsOnCudnnAndMatchesCpu) {
  MT_REQUIRE_GPU();
  LatentAttentionOptions o;
  o.hidden_size = 256;
  o.num_heads = 4;
  o.kv_lora_rank = 128;
  o.qk_nope_head_dim = 128;
  o.qk_rope_head_dim = 64;
  o.v_head_dim = 128;
  o.rope = ops::rope_default_params(64, 10000.0);
  o.rope.interleaved = true;
  const MicroBatch batch = packed({0, 70, 71, 200}, 100);
  Rng rng(6);
  const Tensor x = testing::rounded_to_bf16(testing::random_tensor({200, 256}, DType::F32, rng));
  const Tensor d_out = testing::rounded_to_bf16(testing::random_tensor({200, 256}, DType::F32, rng));
  const Results want = run(o, x, d_out, batch, Device::cpu(), DType::F32);
  const Results got = run(o, x, d_out, batch, Device::cuda(0), DType::BF16);
  // bf16 activations and weight copies through a dozen roundings (2^-9 each) against f32: 3e-2 flags real bugs (a
  // wrong column block, rope pairing or head mapping gives O(1)).
  expect_close(got, want, 3e-2, "bf16 at q/k 192, v 128");
}

}  // namespace
}  // namespace moetrain::model
