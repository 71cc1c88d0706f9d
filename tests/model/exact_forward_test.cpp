// Tests for CausalLm's exact program (set_exact): the residual stream rounded to bf16 after the
// embedding and after every decoder layer, and the per-token log-probs the training forward reports.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "model/causal_lm.h"
#include "ops/elementwise.h"
#include "ops/loss.h"
#include "pipeline/plain_executor.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

model::ModelConfig tiny_moe_config() {
  return model::load_model_config(testing::repo_path("examples/tiny_moe/config.json"));
}

std::vector<int32_t> tokens(int64_t n, int64_t vocab, uint64_t salt) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 37 + salt * 101 + 7) % vocab);
  return ids;
}

// Two documents packed in one run, targets = the next token within the document.
MicroBatch two_documents(int64_t vocab) {
  const std::vector<int32_t> ids = tokens(20, vocab, 3);
  const std::vector<int32_t> cu = {0, 9, 20};
  std::vector<int32_t> targets(ids.size(), ops::kIgnoreIndex);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int32_t t = cu[d]; t + 1 < cu[d + 1]; ++t) targets[static_cast<size_t>(t)] = ids[static_cast<size_t>(t + 1)];
  }
  return MicroBatch::packed(Tensor::from_vector(ids, {20}), Tensor::from_vector(targets, {20}),
                            Tensor::from_vector(cu, {3}));
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

bool on_bf16_grid(const Tensor& t) {
  const float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, p + i, sizeof(bits));
    if ((bits & 0xFFFFu) != 0) return false;
  }
  return true;
}

// The stream's policy is batch-invariant while any exact model holds it: thread ranks sharing a device keep it until
// the last exact model lets go (on the CPU every kernel is batch-invariant anyway; the hold is counted the same).
TEST(ExactForward, ExactModelsHoldTheBatchInvariantPolicyUntilTheLastLetsGo) {
  Stream& stream = default_stream(Device::cpu());
  ASSERT_EQ(stream.policy(), KernelPolicy::Fastest);
  {
    CausalLm first(tiny_moe_config());
    auto second = std::make_unique<CausalLm>(tiny_moe_config());
    first.set_exact(true);
    first.set_exact(true);  // no second hold
    second->set_exact(true);
    EXPECT_EQ(stream.policy(), KernelPolicy::BatchInvariant);
    second.reset();
    EXPECT_EQ(stream.policy(), KernelPolicy::BatchInvariant);
    first.set_exact(false);
    EXPECT_EQ(stream.policy(), KernelPolicy::Fastest);
    first.set_exact(false);  // nothing to let go of
    first.set_exact(true);
    const Stream copy = stream;  // a copy carries the holds it was made with
    EXPECT_EQ(copy.policy(), KernelPolicy::BatchInvariant);
  }
  EXPECT_EQ(stream.policy(), KernelPolicy::Fastest);
}

TEST(ExactForward, IsOffByDefault) {
  const CausalLm model(tiny_moe_config());
  EXPECT_FALSE(model.exact());
}

TEST(ExactForward, RoundsTheResidualToBf16AfterTheEmbeddingAndEveryLayer) {
  CausalLm model(tiny_moe_config());
  model.params().init_random(1234, 0.02);
  model.set_exact(true);
  const MicroBatch batch = two_documents(model.config().vocab_size);

  // The exact program written out by hand: round at the embedding and after each layer.
  Stream& s = default_stream(Device::cpu());
  Tensor hidden = model.embed_forward(batch);
  ops::round_to_bf16_inplace(s, hidden);
  for (const auto& layer : model.layers()) {
    const std::unique_ptr<LayerRecord> record = layer->new_record();  // stages 2 and 4 pass through on one rank
    const Dispatch dispatch = layer->stage1_forward(*record, hidden, batch);
    hidden = layer->stage5_forward(*record, layer->stage3_forward(*record, dispatch.rows, dispatch.group_offsets));
    EXPECT_FALSE(on_bf16_grid(hidden)) << "layer " << layer->index() << ": f32 math inside a layer";
    ops::round_to_bf16_inplace(s, hidden);
    ASSERT_TRUE(on_bf16_grid(hidden));
  }
  EpilogRecord epilog;
  model.head_forward(epilog, hidden, batch, /*loss_scale=*/0.0);
  const Tensor expected = token_logprobs_from_losses(epilog.losses, batch.targets);

  ForwardObservation exact;
  pipeline::forward_only(model, {batch}, &exact);
  ASSERT_EQ(exact.token_logprobs.size(), 1u);
  EXPECT_TRUE(same_bytes(exact.token_logprobs[0], expected));

  // Exact off is the plain f32 program: it differs from the rounded one.
  model.set_exact(false);
  ForwardObservation plain;
  pipeline::forward_only(model, {batch}, &plain);
  EXPECT_FALSE(same_bytes(plain.token_logprobs[0], expected));
  EXPECT_LT(testing::relative_error(plain.token_logprobs[0], expected), 1e-2);
}

TEST(ExactForward, TokenLogprobsAreMinusTheLossesAndPositiveZeroWhereIgnored) {
  const Tensor losses = Tensor::from_vector<float>({2.5f, 0.0f, -0.0f, 7.0f, 1.25f}, {5});
  const Tensor targets = Tensor::from_vector<int32_t>({3, 4, 5, ops::kIgnoreIndex, 6}, {5});
  const std::vector<float> lp = token_logprobs_from_losses(losses, targets).to_vector<float>();
  EXPECT_EQ(lp[0], -2.5f);
  EXPECT_EQ(lp[4], -1.25f);
  for (size_t i : {1u, 2u, 3u}) {
    EXPECT_EQ(lp[i], 0.0f) << i;
    EXPECT_FALSE(std::signbit(lp[i])) << "entry " << i << " is -0.0";
  }
  EXPECT_THROW(token_logprobs_from_losses(losses, Tensor::from_vector<int32_t>({1, 2}, {2})), Error);
  EXPECT_THROW(token_logprobs_from_losses(losses, losses), Error);
}

TEST(ExactForward, TrainingForwardReportsTheBytesOfTheForwardOnlyPath) {
  CausalLm model(tiny_moe_config());
  model.params().init_random(7, 0.02);
  for (const bool exact : {false, true}) {
    model.set_exact(exact);
    const MicroBatch batch = two_documents(model.config().vocab_size);
    ForwardObservation trained, scored;
    const StepLoss train_loss = pipeline::forward_backward(model, {batch, batch}, 0, &trained);
    const StepLoss score_loss = pipeline::forward_only(model, {batch}, &scored);
    ASSERT_EQ(trained.token_logprobs.size(), 2u);
    ASSERT_EQ(scored.token_logprobs.size(), 1u);
    EXPECT_TRUE(same_bytes(trained.token_logprobs[0], scored.token_logprobs[0])) << "exact " << exact;
    EXPECT_TRUE(same_bytes(trained.token_logprobs[1], scored.token_logprobs[0])) << "exact " << exact;
    EXPECT_EQ(train_loss.loss, score_loss.loss) << "exact " << exact;
    // The log-probs are the loss: their negated mean over the counted targets.
    double sum = 0.0;
    for (float v : scored.token_logprobs[0].to_vector<float>()) sum -= v;
    EXPECT_NEAR(sum / static_cast<double>(batch.num_targets()), score_loss.loss, 1e-5 * score_loss.loss);
  }
}

}  // namespace
}  // namespace moetrain::model
