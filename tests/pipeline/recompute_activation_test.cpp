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
#include "testing/cuda_compare.h"
#include "testing/executor_fixtures.h"
#include "testing/test_data.h"
#include "train/job_model.h"

namespace moetrain::pipeline {
namespace {

using fixtures::bitwise_equal;
using fixtures::make_batches;
using testing::expect_error;

TEST(RecomputeActivation, TrainsToTheSameBitsAsKeepingTheActivation) {
  for (const char* name : {"../../examples/tiny_moe/config.json", "golden/qwen3/config.json",
                           "golden/gpt_oss/config.json", "golden/qwen3_5_moe/config.json"}) {
    SCOPED_TRACE(name);
    const model::ModelConfig config = model::load_model_config(testing::test_data_path(name));
    // Two micro-batches of one to three documents each: the weight gradients accumulate over the step.
    const std::vector<model::MicroBatch> batches = make_batches(2, 31, config.vocab_size);
    model::CausalLm kept(config), recomputed(config);
    recomputed.set_recompute_activation(true);
    EXPECT_TRUE(recomputed.recompute_activation());
    EXPECT_FALSE(kept.recompute_activation());
    for (model::CausalLm* m : {&kept, &recomputed}) m->params().init_random(17, 0.05);
    const double loss_kept = forward_backward(kept, batches).loss;
    const double loss_recomputed = forward_backward(recomputed, batches).loss;
    EXPECT_EQ(std::memcmp(&loss_kept, &loss_recomputed, sizeof(double)), 0) << loss_kept << " vs " << loss_recomputed;
    const std::vector<Tensor> want = kept.params().all_grads(), got = recomputed.params().all_grads();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(got[i], want[i])) << kept.params().specs()[i].name;
    }
  }
}

TEST(RecomputeActivation, TheJobKeyIsValidatedAndReachesTheModel) {
  const std::string config = testing::repo_path("examples/tiny_moe/config.json");
  const auto job = [&](const std::string& recompute) {
    return io::parse_job_config(
        "[model]\nconfig = \"" + config + "\"\nrecompute = \"" + recompute +
            "\"\n[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 16\nmicro_batch = 1\nglobal_batch = 1\n",
        "recompute test", {});
  };
  EXPECT_TRUE(train::job_model(job("activation"))->recompute_activation());
  EXPECT_FALSE(train::job_model(job("none"))->recompute_activation());
  expect_error([&] { job("everything"); }, {"model.recompute must be none or activation but is 'everything'"});
}

}  // namespace
}  // namespace moetrain::pipeline
