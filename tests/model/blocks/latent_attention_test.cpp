// Tests for the latent attention block (model/blocks/latent_attention.h) on the CPU: its parameters (with and
// without the q LoRA), the refusals of inconsistent options, and that a packed document's output and input gradient
// are the bytes of the document alone (attention never crosses documents, the shared rotary key included). Its math
// against transformers is check-golden's (tests/cli/check_golden_test.cpp, the deepseek_v2 dump).
#include "model/blocks/latent_attention.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

LatentAttentionOptions options(int64_t q_lora) {
  LatentAttentionOptions o;
  o.hidden_size = 32;
  o.num_heads = 2;
  o.q_lora_rank = q_lora;
  o.kv_lora_rank = 16;
  o.qk_nope_head_dim = 8;
  o.qk_rope_head_dim = 4;
  o.v_head_dim = 6;
  o.rope = ops::rope_default_params(4, 10000.0);
  o.rope.interleaved = true;
  return o;
}

TEST(LatentAttention, DeclaresItsParameters) {
  std::vector<std::string> names;
  for (const ParamSpec& s : LatentAttention::param_specs(options(0), "a.", 3)) {
    names.push_back(s.name);
    EXPECT_EQ(s.layer, 3);
    EXPECT_EQ(s.role, s.is_matrix() ? ParamRole::Dense : ParamRole::Norm) << s.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"a.q_proj", "a.kv_a_proj", "a.kv_a_norm", "a.kv_b_proj", "a.o_proj"}));
  const std::vector<ParamSpec> lora = LatentAttention::param_specs(options(12), "a.", 0);
  EXPECT_EQ(lora[0].name, "a.q_a_proj");
  EXPECT_EQ(lora[0].shape, (Shape{12, 32}));
  EXPECT_EQ(lora[2].shape, (Shape{2 * 12, 12}));  // q_b_proj: heads x (nope + rope) rows
  EXPECT_EQ(lora[3].shape, (Shape{16 + 4, 32}));  // kv_a_proj: the latent and the rotary key
  EXPECT_EQ(lora[5].shape, (Shape{2 * (8 + 6), 16}));
  EXPECT_EQ(lora[6].shape, (Shape{32, 2 * 6}));
}

TEST(LatentAttention, RefusesInconsistentOptions) {
  LatentAttentionOptions o = options(0);
  ParameterStore store(block_testing::with_whole_pieces(LatentAttention::param_specs(o, "a.", 0)));
  o.rope = ops::rope_default_params(8, 10000.0);  // the rope must cover exactly the rotary key's dims
  EXPECT_TRUE(block_testing::contains(block_testing::error_message([&] { LatentAttention(o, store, "a."); }),
                                      "rope covers 8 dims but the rotary key has 4"));
  o = options(0);
  o.rope.first_rotated_dim = 2;  // the block places the rotation itself
  EXPECT_TRUE(block_testing::contains(block_testing::error_message([&] { LatentAttention(o, store, "a."); }),
                                      "first_rotated_dim is 2, expected 0"));
  o = options(0);
  o.v_head_dim = 0;
  EXPECT_TRUE(block_testing::contains(block_testing::error_message([&] { LatentAttention(o, store, "a."); }),
                                      "expected positive sizes"));
}

TEST(LatentAttention, APackedDocumentGivesTheBytesOfTheDocumentAlone) {
  const LatentAttentionOptions o = options(12);
  ParameterStore store(block_testing::with_whole_pieces(LatentAttention::param_specs(o, "a.", 0)));
  block_testing::fill_random(store, 3, 0.2);
  LatentAttention block(o, store, "a.");
  Rng rng(4);
  const Tensor x = testing::random_tensor({11, 32}, DType::F32, rng);
  const Tensor d_out = testing::random_tensor({11, 32}, DType::F32, rng);
  const auto run = [&](int64_t begin, int64_t end, const std::vector<int32_t>& cu) {
    const int64_t T = end - begin;
    const MicroBatch batch = MicroBatch::packed(Tensor::zeros({T}, DType::I32), Tensor::zeros({T}, DType::I32),
                                                Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}));
    auto record = block.new_record();
    const Tensor out = block.forward(*record, x.slice(begin, end).clone(), batch);
    const Tensor dx = block.backward_input(*record, d_out.slice(begin, end).clone());
    return std::pair{out, dx};
  };
  const auto [out, dx] = run(0, 11, {0, 4, 11});
  const auto [out_b, dx_b] = run(4, 11, {0, 7});
  EXPECT_EQ(std::memcmp(out.slice(4, 11).clone().raw_data(), out_b.raw_data(), out_b.nbytes()), 0);
  EXPECT_EQ(std::memcmp(dx.slice(4, 11).clone().raw_data(), dx_b.raw_data(), dx_b.nbytes()), 0);
}

}  // namespace
}  // namespace moetrain::model
