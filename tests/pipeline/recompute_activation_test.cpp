// Tests of model.recompute = activation (CausalLm::set_recompute_activation): every gated MLP recomputes its
// activation in the backward instead of keeping it, and a training step gives the same bits (loss and every
// gradient) as keeping it, for a dense MLP (qwen3), routed experts (the tiny Qwen3-MoE example), the clamped SwiGLU
// with biases (gpt_oss) and a gated shared expert (qwen3_5_moe); the job key is validated and reaches the model.
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "io/job_config.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "pipeline/plain_executor.h"
#include "testing/test_data.h"
#include "train/job_model.h"

namespace moetrain::pipeline {
namespace {

// Two packed documents with next-token targets.
model::MicroBatch two_documents(int64_t vocab) {
  const int64_t T = 30;
  std::vector<int32_t> ids(T), targets(T);
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>((t * 29 + 3) % vocab);
  for (int64_t t = 0; t < T; ++t) {
    targets[static_cast<size_t>(t)] = t == 17 || t == T - 1 ? -100 : ids[static_cast<size_t>(t + 1)];
  }
  return model::MicroBatch::packed(Tensor::from_vector(ids, {T}), Tensor::from_vector(targets, {T}),
                                   Tensor::from_vector<int32_t>({0, 18, int32_t(T)}, {3}));
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

TEST(RecomputeActivation, TrainsToTheSameBitsAsKeepingTheActivation) {
  for (const char* name : {"../../examples/tiny_moe/config.json", "golden/qwen3/config.json",
                           "golden/gpt_oss/config.json", "golden/qwen3_5_moe/config.json"}) {
    SCOPED_TRACE(name);
    const model::ModelConfig config = model::load_model_config(testing::test_data_path(name));
    const model::MicroBatch batch = two_documents(config.vocab_size);
    model::CausalLm kept(config), recomputed(config);
    recomputed.set_recompute_activation(true);
    EXPECT_TRUE(recomputed.recompute_activation());
    EXPECT_FALSE(kept.recompute_activation());
    for (model::CausalLm* m : {&kept, &recomputed}) m->params().init_random(17, 0.05);
    // Two micro-batches: the second one's records are made while the first one's weight gradients are in.
    const double loss_kept = forward_backward(kept, {batch, batch}).loss;
    const double loss_recomputed = forward_backward(recomputed, {batch, batch}).loss;
    EXPECT_EQ(std::memcmp(&loss_kept, &loss_recomputed, sizeof(double)), 0) << loss_kept << " vs " << loss_recomputed;
    const std::vector<Tensor> want = kept.params().all_grads(), got = recomputed.params().all_grads();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(same_bits(got[i], want[i])) << kept.params().specs()[i].name;
    }
  }
}

TEST(RecomputeActivation, TheJobKeyIsValidatedAndReachesTheModel) {
  const std::string config = testing::test_data_path("../../examples/tiny_moe/config.json");
  const auto job = [&](const std::string& recompute) {
    return io::parse_job_config(
        "[model]\nconfig = \"" + config + "\"\nrecompute = \"" + recompute +
            "\"\n[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 16\nmicro_batch = 1\nglobal_batch = 1\n",
        "recompute test", {});
  };
  EXPECT_TRUE(train::job_model(job("activation"))->recompute_activation());
  EXPECT_FALSE(train::job_model(job("none"))->recompute_activation());
  try {
    job("everything");
    ADD_FAILURE() << "model.recompute = everything was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.recompute must be none or activation but is 'everything'"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moetrain::pipeline
