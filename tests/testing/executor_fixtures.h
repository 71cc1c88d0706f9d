// defines: what the pipeline executors' tests share: the tiny MoE example model from a seed, random
// packed micro-batches of unequal documents, and the step's active router-loss settings.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "model/router_loss.h"
#include "testing/test_data.h"

namespace moetrain::pipeline::fixtures {

inline model::ModelConfig tiny_moe() {
  return model::load_model_config(testing::repo_path("examples/tiny_moe/config.json"));
}

inline std::unique_ptr<model::CausalLm> make_model(const model::ModelConfig& config, uint64_t seed) {
  auto model = std::make_unique<model::CausalLm>(config);
  model->params().init_random(seed, 0.05);
  return model;
}

// n packed micro-batches of 1 to 3 documents of min_len to max_len tokens (unequal token counts); targets
// are the next token inside each document, -100 at each document's end and at a few random positions.
inline std::vector<model::MicroBatch> make_batches(int n, uint64_t seed, int64_t vocab, int min_len = 3,
                                                   int max_len = 16) {
  Rng rng(seed);
  std::vector<model::MicroBatch> batches;
  for (int mb = 0; mb < n; ++mb) {
    const int docs = 1 + static_cast<int>(rng.below(3));
    std::vector<int32_t> ids, targets, cu{0};
    for (int d = 0; d < docs; ++d) {
      const int len = min_len + static_cast<int>(rng.below(static_cast<uint64_t>(max_len - min_len + 1)));
      for (int t = 0; t < len; ++t) ids.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab))));
      for (int t = 0; t < len; ++t) {
        const size_t at = static_cast<size_t>(cu.back() + t);
        const bool counted = t + 1 < len && rng.below(8) != 0;
        targets.push_back(counted ? ids[at + 1] : -100);
      }
      cu.push_back(cu.back() + len);
    }
    const int64_t T = static_cast<int64_t>(ids.size());
    batches.push_back(model::MicroBatch::packed(Tensor::from_vector(ids, {T}), Tensor::from_vector(targets, {T}),
                                                Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())})));
  }
  return batches;
}

inline int64_t count_targets(const std::vector<model::MicroBatch>& batches) {
  int64_t n = 0;
  for (const model::MicroBatch& b : batches) n += b.num_targets();
  return n;
}

// Active auxiliary router losses (per micro-batch load balance, z-loss and DeepSeek-V2's device balance over 2
// groups of experts), so their values and gradients are covered too.
inline model::RouterLossSettings router_settings(const model::ModelConfig& config, int64_t global_targets) {
  model::RouterLossSettings s;
  s.variant = model::LoadBalanceVariant::MicroBatch;
  s.load_balance_coef = 0.01;
  s.z_loss_coef = 0.001;
  s.device_balance_coef = 0.005;
  s.device_balance_groups = 2;
  s.loss_scale = 1.0 / static_cast<double>(global_targets);
  s.num_moe_layers = 0;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) s.num_moe_layers += config.layer_is_moe(l) ? 1 : 0;
  return s;
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0;
}

}  // namespace moetrain::pipeline::fixtures
