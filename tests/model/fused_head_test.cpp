// Tests for the fused LM head (CausalLm::head_forward with a head chunk, over ops/linear_cross_entropy.h) at the model
// level: forward_backward and forward_only with the vocabulary in several chunks give the unfused head's losses and
// gradients, one chunk gives the same bytes, observing the logits keeps the materialised path, and the split
// backward calls hold the loss scale the forward used.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "pipeline/plain_executor.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

std::unique_ptr<CausalLm> golden_model(const std::string& family) {
  return CausalLm::from_hf(testing::test_data_path("golden/" + family));
}

io::SafetensorsReader golden_reference(const std::string& family) {
  return io::SafetensorsReader::open(testing::test_data_path("golden/" + family + "/reference.safetensors"));
}

// The golden batch as two micro-batches (row 0, row 1): unequal target counts, one loss scale for both.
std::vector<MicroBatch> golden_batches(const std::string& family) {
  const auto ref = golden_reference(family);
  const Tensor ids = ref.tensor("input_ids").clone();
  const Tensor targets = ref.tensor("targets").clone();
  return {MicroBatch::from_rows(ids.slice(0, 1), targets.slice(0, 1)),
          MicroBatch::from_rows(ids.slice(1, 2), targets.slice(1, 2))};
}

struct StepResult {
  StepLoss loss;
  std::vector<Tensor> grads;
};

// forward_backward from zeroed gradients with the given head chunk (0: materialised logits).
StepResult train_step(CausalLm& model, const std::vector<MicroBatch>& batches, int64_t chunk,
                      ForwardObservation* observe = nullptr) {
  model.set_head_chunk(chunk);
  model.params().zero_grads();
  StepResult r;
  r.loss = pipeline::forward_backward(model, batches, 0, observe);
  for (const Tensor& g : model.params().all_grads()) r.grads.push_back(g.clone());
  return r;
}

class FusedHead : public ::testing::TestWithParam<const char*> {};

TEST_P(FusedHead, ChunkedHeadGivesTheUnfusedLossAndGradients) {
  auto model = golden_model(GetParam());
  const auto batches = golden_batches(GetParam());
  const StepResult unfused = train_step(*model, batches, 0);
  // 7 does not divide V = 512: 74 chunks, the last one of 1 column.
  for (int64_t chunk : {7, 128, 511}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const StepResult fused = train_step(*model, batches, chunk);
    EXPECT_EQ(fused.loss.num_targets, unfused.loss.num_targets);
    EXPECT_NEAR(fused.loss.loss, unfused.loss.loss, 1e-6 * std::abs(unfused.loss.loss));
    ASSERT_EQ(fused.grads.size(), unfused.grads.size());
    for (size_t i = 0; i < fused.grads.size(); ++i)
      EXPECT_LT(testing::relative_error(fused.grads[i], unfused.grads[i]), 1e-6) << model->params().specs()[i].name;
  }
}

TEST_P(FusedHead, OneChunkIsBitwiseTheUnfusedHead) {
  auto model = golden_model(GetParam());
  const auto batches = golden_batches(GetParam());
  const StepResult unfused = train_step(*model, batches, 0);
  const StepResult fused = train_step(*model, batches, 512);
  EXPECT_EQ(fused.loss.ce_sum, unfused.loss.ce_sum);
  for (size_t i = 0; i < fused.grads.size(); ++i) {
    EXPECT_EQ(fused.grads[i].to_vector<float>(), unfused.grads[i].to_vector<float>())
        << model->params().specs()[i].name;
  }
}

TEST_P(FusedHead, ObservingTheLogitsKeepsTheMaterialisedHead) {
  auto model = golden_model(GetParam());
  const auto batches = golden_batches(GetParam());
  const StepResult unfused = train_step(*model, batches, 0);
  ForwardObservation observe;
  const StepResult observed = train_step(*model, batches, 7, &observe);
  ASSERT_EQ(observe.logits.size(), batches.size());
  for (size_t b = 0; b < batches.size(); ++b) {
    ASSERT_TRUE(observe.logits[b].defined());
    EXPECT_EQ(observe.logits[b].shape(), (Shape{batches[b].num_tokens(), model->config().vocab_size}));
  }
  EXPECT_EQ(observed.loss.ce_sum, unfused.loss.ce_sum);
  for (size_t i = 0; i < observed.grads.size(); ++i) {
    EXPECT_EQ(observed.grads[i].to_vector<float>(), unfused.grads[i].to_vector<float>())
        << model->params().specs()[i].name;
  }
}

TEST_P(FusedHead, ForwardOnlyMatchesTheUnfusedHead) {
  auto model = golden_model(GetParam());
  const auto batches = golden_batches(GetParam());
  model->set_head_chunk(0);
  const StepLoss unfused = pipeline::forward_only(*model, batches);
  model->set_head_chunk(7);
  const StepLoss fused = pipeline::forward_only(*model, batches);
  EXPECT_EQ(fused.num_targets, unfused.num_targets);
  EXPECT_NEAR(fused.loss, unfused.loss, 1e-6 * std::abs(unfused.loss));
}

TEST_P(FusedHead, SplitBackwardCallsFinishTheFusedForward) {
  // the fused head_forward + head_backward_input + head_backward_weight, as the pipeline would call them, against the
  // unfused calls: the same d_hidden and final-norm / head gradients.
  auto model = golden_model(GetParam());
  const auto ref = golden_reference(GetParam());
  const MicroBatch batch = MicroBatch::from_rows(ref.tensor("input_ids").clone(), ref.tensor("targets").clone());
  Rng rng(5);
  const Tensor hidden = testing::random_tensor({batch.num_tokens(), model->config().hidden_size}, DType::F32, rng);
  const double scale = 1.0 / double(batch.num_targets());
  auto head_grads = [&](bool fused) {
    model->params().zero_grads();
    model->set_head_chunk(fused ? 100 : 0);
    EpilogRecord r;
    const LossSum sum = model->head_forward(r, hidden, batch, scale);
    std::vector<Tensor> out = {Tensor::from_vector(std::vector<double>{sum.ce_sum()}, {1}),
                               model->head_backward_input(r, scale)};
    model->head_backward_weight(r);
    out.push_back(model->params().grad("final_norm").clone());
    out.push_back(model->params().grad(model->params().contains("lm_head") ? "lm_head" : "embed").clone());
    return out;
  };
  const auto fused = head_grads(true);
  const auto unfused = head_grads(false);
  const char* names[] = {"ce_sum", "d_hidden", "final_norm grad", "head grad"};
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_LT(testing::relative_error(fused[i], unfused[i]), 1e-6) << names[i];
}

TEST_P(FusedHead, BackwardRejectsAnotherLossScale) {
  auto model = golden_model(GetParam());
  const auto ref = golden_reference(GetParam());
  const MicroBatch batch = MicroBatch::from_rows(ref.tensor("input_ids").clone(), ref.tensor("targets").clone());
  Rng rng(6);
  const Tensor hidden = testing::random_tensor({batch.num_tokens(), model->config().hidden_size}, DType::F32, rng);
  EpilogRecord r;
  model->head_forward(r, hidden, batch, 0.25);
  try {
    model->head_backward_input(r, 0.5);
    ADD_FAILURE() << "expected a moetrain::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loss scale 0.25 but the backward asks for 0.5"), std::string::npos)
        << e.what();
  }
  // The materialised head (head chunk 0) makes the logits' gradient in its forward too when nobody keeps them.
  const int64_t fused_chunk = model->head_chunk();
  model->set_head_chunk(0);
  EpilogRecord materialised;
  model->head_forward(materialised, hidden, batch, 0.25);
  EXPECT_TRUE(materialised.logits_hold_gradient);
  try {
    model->head_backward_input(materialised, 0.5);
    ADD_FAILURE() << "expected a moetrain::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("materialised head's forward produced gradients for loss scale 0.25 but the "
                                         "backward asks for 0.5"),
              std::string::npos)
        << e.what();
  }
  EpilogRecord kept;
  model->head_forward(kept, hidden, batch, 0.25, /*keep_logits=*/true);
  EXPECT_FALSE(kept.logits_hold_gradient) << "kept logits must stay logits until the backward";
  model->set_head_chunk(fused_chunk);
  EpilogRecord forward_only_record;
  model->head_forward(forward_only_record, hidden, batch, 0.0);
  try {
    model->head_backward_input(forward_only_record, 0.25);
    ADD_FAILURE() << "expected a moetrain::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds no logits"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, FusedHead, ::testing::Values("qwen3", "qwen3_moe"));

}  // namespace
}  // namespace moetrain::model
