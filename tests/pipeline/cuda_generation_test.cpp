// Tests of generate on the GPU: the same model and weights on the CPU score what the GPU generated, and the
// log-probs agree within the kernels' tolerance (f32 compute: 1e-4; bf16 compute: the bf16 rounding of the
// activations, 0.1 nats), for the tiny Qwen3-MoE example, GPT-OSS, DeepSeek-V2 and Qwen3.5-MoE. (In exact mode the
// GPU's log-probs are score's bytes on the GPU: tests/cli/cuda_exact_test.cpp.)
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "pipeline/generation.h"
#include "pipeline/plain_executor.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::pipeline {
namespace {

void expect_gpu_generation_scores_on_cpu(const std::string& config_path, DType compute) {
  SCOPED_TRACE(config_path + " " + std::string(dtype_name(compute)));
  const model::ModelConfig config = model::load_model_config(config_path);
  model::CausalLm cpu_model(config), gpu_model(config, Device::cuda(0), compute);
  cpu_model.params().init_random(31, 0.05);
  gpu_model.params().init_random(31, 0.05);
  GenerationRequest request;
  request.input_ids = Tensor::from_vector<int32_t>({3, 17, 42, 5, 9, 1, 11, 12, 13, 14, 15, 16}, {2, 6});
  request.lengths = {6, 4};
  request.max_new_tokens = 10;
  request.temperature = 0.8;
  request.seed = 4;
  const Generation out = generate(gpu_model, request);
  const double tolerance = compute == DType::BF16 ? 0.1 : 1e-4;
  for (int64_t b = 0; b < 2; ++b) {
    const int32_t len = request.lengths[static_cast<size_t>(b)];
    const int64_t T = len + 10;
    std::vector<int32_t> ids(out.tokens.data<int32_t>() + b * 16, out.tokens.data<int32_t>() + b * 16 + T);
    std::vector<int32_t> targets(static_cast<size_t>(T), -100);
    for (int64_t t = 0; t + 1 < T; ++t) targets[static_cast<size_t>(t)] = ids[static_cast<size_t>(t + 1)];
    const model::MicroBatch batch =
        model::MicroBatch::packed(Tensor::from_vector(ids, {T}), Tensor::from_vector(targets, {T}),
                                  Tensor::from_vector<int32_t>({0, int32_t(T)}, {2}));
    const Tensor scored = PlainExecutor(cpu_model, nullptr).run_forward({batch})[0];
    for (int64_t n = 0; n < 10; ++n) {
      const float want = scored.data<float>()[len - 1 + n], got = out.logprobs.data<float>()[b * 10 + n];
      EXPECT_TRUE(std::isfinite(got));
      EXPECT_NEAR(got, want, tolerance * std::max(1.0f, std::abs(want))) << "row " << b << " step " << n;
    }
  }
}

TEST(CudaGeneration, GpuGenerationScoresAlikeOnTheCpu) {
  MT_REQUIRE_GPU();
  const std::string tiny = testing::repo_path("examples/tiny_moe/config.json");
  for (const std::string& path : {tiny, testing::test_data_path("golden/gpt_oss/config.json"),
                                  testing::test_data_path("golden/deepseek_v2/config.json"),
                                  testing::test_data_path("golden/qwen3_5_moe/config.json")}) {
    expect_gpu_generation_scores_on_cpu(path, DType::F32);
    expect_gpu_generation_scores_on_cpu(path, DType::BF16);
  }
}

}  // namespace
}  // namespace moetrain::pipeline
