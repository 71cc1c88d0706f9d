// defines: the load-balance and z-loss values and their router gradients (host math on the CPU
// tensors of one micro-batch; every sum runs in a fixed order).
#include "model/router_loss.h"

#include <cmath>

namespace moetrain::model {

namespace {

struct Segment {
  int64_t begin, end;
};

std::vector<Segment> balance_sets(LoadBalanceVariant variant, const Tensor& cu_seqlens, int64_t tokens) {
  if (variant != LoadBalanceVariant::Sequence) return {{0, tokens}};
  std::vector<Segment> sets;
  const int32_t* cu = cu_seqlens.data<int32_t>();
  for (int64_t d = 0; d + 1 < cu_seqlens.numel(); ++d) sets.push_back({cu[d], cu[d + 1]});
  return sets;
}

}  // namespace

LoadBalanceVariant parse_load_balance_variant(const std::string& name) {
  if (name == "micro_batch") return LoadBalanceVariant::MicroBatch;
  if (name == "global_batch") return LoadBalanceVariant::GlobalBatch;
  if (name == "sequence") return LoadBalanceVariant::Sequence;
  MT_FAIL("loss.load_balance: expected micro_batch, global_batch or sequence but found '{}'", name);
}

void RouterLossValues::resolve() {
  if (!on_device.defined()) return;
  const std::vector<float> host = on_device.to(Device::cpu()).to_vector<float>();
  load_balance = host.at(0);
  z_loss = host.at(1);
  on_device = Tensor();
}

RouterLossValues router_aux_losses(const RouterLossSettings& s, int64_t moe_layer, const Tensor& logits,
                                   const Tensor& probs, const Tensor& topk_index, const Tensor& cu_seqlens,
                                   Tensor& d_probs, Tensor& d_logits) {
  MT_CHECK(logits.device().is_cpu(), "router loss: the auxiliary losses run on the CPU so far, found {}",
           logits.describe());
  expect_dtype(logits, DType::F32, "router loss logits");
  const int64_t T = logits.size(0), E = logits.size(1), K = topk_index.size(1);
  const float* p = probs.data<float>();
  const float* z = logits.data<float>();
  const int32_t* idx = topk_index.data<int32_t>();
  const double layer_scale = s.loss_scale / static_cast<double>(s.num_moe_layers);
  RouterLossValues values;
  values.tokens = T;
  d_probs = Tensor::zeros({T, E}, DType::F32);
  d_logits = Tensor::zeros({T, E}, DType::F32);

  if (s.load_balance_coef > 0.0) {
    float* dp = d_probs.data<float>();
    std::vector<double> global_fraction;
    if (s.variant == LoadBalanceVariant::GlobalBatch) {
      MT_CHECK(s.running_counts != nullptr && moe_layer < static_cast<int64_t>(s.running_counts->size()),
               "router loss: global_batch needs the step's running expert counts for MoE layer {}", moe_layer);
      std::vector<double>& running = (*s.running_counts)[moe_layer];
      running.resize(static_cast<size_t>(E), 0.0);
      for (int64_t i = 0; i < T * K; ++i) running[idx[i]] += 1.0;
      double total = 0.0;
      for (double c : running) total += c;
      for (double c : running) global_fraction.push_back(c / total);
    }
    for (const Segment& set : balance_sets(s.variant, cu_seqlens, T)) {
      const int64_t n = set.end - set.begin;
      std::vector<double> fraction(static_cast<size_t>(E), 0.0), mean_prob(static_cast<size_t>(E), 0.0);
      for (int64_t t = set.begin; t < set.end; ++t) {
        for (int64_t k = 0; k < K; ++k) fraction[idx[t * K + k]] += 1.0 / static_cast<double>(n * K);
        for (int64_t e = 0; e < E; ++e) mean_prob[e] += p[t * E + e] / static_cast<double>(n);
      }
      if (!global_fraction.empty()) fraction = global_fraction;
      double value = 0.0;
      for (int64_t e = 0; e < E; ++e) value += static_cast<double>(E) * fraction[e] * mean_prob[e];
      values.load_balance += value * static_cast<double>(n) / static_cast<double>(T);
      // d(coef * n * value * layer_scale) / d p[t, e] = coef * E * f_e * layer_scale (the 1/n of P cancels n).
      for (int64_t t = set.begin; t < set.end; ++t) {
        for (int64_t e = 0; e < E; ++e) {
          dp[t * E + e] = static_cast<float>(s.load_balance_coef * static_cast<double>(E) * fraction[e] * layer_scale);
        }
      }
    }
  }
  if (s.z_loss_coef > 0.0) {
    float* dz = d_logits.data<float>();
    double sum = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      double max = z[t * E];
      for (int64_t e = 1; e < E; ++e) max = std::max(max, static_cast<double>(z[t * E + e]));
      double total = 0.0;
      for (int64_t e = 0; e < E; ++e) total += std::exp(z[t * E + e] - max);
      const double lse = max + std::log(total);
      sum += lse * lse;
      for (int64_t e = 0; e < E; ++e) {
        const double softmax = std::exp(z[t * E + e] - lse);
        dz[t * E + e] = static_cast<float>(s.z_loss_coef * 2.0 * lse * softmax * layer_scale);
      }
    }
    values.z_loss = sum / static_cast<double>(T);
  }
  return values;
}

}  // namespace moetrain::model
