// defines: the load-balance, device-balance and z-loss values and their router gradients: argument checks
// for both backends, host math on the CPU tensors of one micro-batch (every sum in a fixed order), and the
// dispatch of CUDA tensors to ops/cuda/router_aux (same formulas, values left on the device).
#include "model/router_loss.h"

#include <algorithm>
#include <cmath>

#if MOETRAIN_HAS_CUDA
#include "ops/cuda/router_aux.h"
#endif

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

// A balance set's statistics: f_e, the fraction of its n * K choices that picked e, and P_e, the mean of the
// probabilities of e over its tokens.
struct SetStatistics {
  std::vector<double> fraction, mean_prob;
};

SetStatistics set_statistics(const float* p, const int32_t* idx, Segment set, int64_t E, int64_t K) {
  const int64_t n = set.end - set.begin;
  SetStatistics st{std::vector<double>(static_cast<size_t>(E), 0.0), std::vector<double>(static_cast<size_t>(E), 0.0)};
  for (int64_t t = set.begin; t < set.end; ++t) {
    for (int64_t k = 0; k < K; ++k) st.fraction[idx[t * K + k]] += 1.0 / static_cast<double>(n * K);
    for (int64_t e = 0; e < E; ++e) st.mean_prob[e] += p[t * E + e] / static_cast<double>(n);
  }
  return st;
}

// Shapes, dtypes, devices and settings, for both backends (values only on the CPU, see the caller).
void validate(const RouterLossSettings& s, int64_t moe_layer, const Tensor& logits, const Tensor& probs,
              const Tensor& topk_index, const Tensor& cu_seqlens) {
  expect_defined(logits, "router loss: logits");
  expect_dtype(logits, DType::F32, "router loss: logits");
  MT_CHECK(logits.dim() == 2, "router loss: logits must be [T, E] but are {}", logits.describe());
  const int64_t T = logits.size(0), E = logits.size(1);
  MT_CHECK(E > 0, "router loss: logits {} have no expert", logits.describe());
  expect_contiguous(logits, "router loss: logits");
  expect_shape(probs, {T, E}, "router loss: probs");
  expect_dtype(probs, DType::F32, "router loss: probs");
  expect_contiguous(probs, "router loss: probs");
  expect_same_device(probs, logits, "router loss: probs");
  expect_dtype(topk_index, DType::I32, "router loss: topk_index");
  MT_CHECK(topk_index.dim() == 2 && topk_index.size(0) == T && topk_index.size(1) > 0,
           "router loss: topk_index must be [T = {}, K > 0] but is {}", T, topk_index.describe());
  expect_contiguous(topk_index, "router loss: topk_index");
  expect_same_device(topk_index, logits, "router loss: topk_index");
  MT_CHECK(s.num_moe_layers > 0, "router loss: num_moe_layers must be > 0 but is {}", s.num_moe_layers);
  if (s.device_balance_coef > 0.0) {
    MT_CHECK(s.device_balance_groups >= 1 && E % s.device_balance_groups == 0,
             "router loss: the device-level balance needs D >= 1 groups dividing the E = {} experts, but D = {} "
             "(loss.device_balance_groups)",
             E, s.device_balance_groups);
  }
  if (s.load_balance_coef > 0.0 && s.variant == LoadBalanceVariant::Sequence) {
    expect_dtype(cu_seqlens, DType::I32, "router loss: cu_seqlens");
    MT_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, "router loss: cu_seqlens must be [D + 1] but is {}",
             cu_seqlens.describe());
    expect_contiguous(cu_seqlens, "router loss: cu_seqlens");
    expect_same_device(cu_seqlens, logits, "router loss: cu_seqlens (pass the copy on the router's device)");
  }
  if (s.load_balance_coef > 0.0 && s.variant == LoadBalanceVariant::GlobalBatch) {
    MT_CHECK(
        s.running_counts != nullptr && moe_layer >= 0 && moe_layer < static_cast<int64_t>(s.running_counts->size()),
        "router loss: global_batch needs the step's running expert counts for MoE layer {} ({} given)", moe_layer,
        s.running_counts ? s.running_counts->size() : 0);
  }
}

}  // namespace

LoadBalanceVariant parse_load_balance_variant(const std::string& name) {
  if (name == "micro_batch") return LoadBalanceVariant::MicroBatch;
  if (name == "global_batch") return LoadBalanceVariant::GlobalBatch;
  if (name == "sequence") return LoadBalanceVariant::Sequence;
  MT_FAIL("loss.load_balance: expected micro_batch, global_batch or sequence but found '{}'", name);
}

int64_t resolve_device_balance_groups(int64_t configured, int64_t ep_size, int64_t num_experts) {
  MT_CHECK(configured >= 0, "loss.device_balance_groups must be >= 0 (0: the expert-parallel degree) but is {}",
           configured);
  MT_CHECK(ep_size >= 1, "loss.device_balance_groups: the expert-parallel degree must be >= 1 but is {}", ep_size);
  const int64_t groups = configured > 0 ? configured : ep_size;
  MT_CHECK(num_experts == 0 || num_experts % groups == 0,
           "loss.device_balance_groups: {} groups{} do not divide the model's {} experts; set "
           "loss.device_balance_groups to a divisor of {}",
           groups, configured > 0 ? "" : " (0: the expert-parallel degree)", num_experts, num_experts);
  return groups;
}

void RouterLossValues::resolve() {
  if (!on_device.defined()) return;
  const std::vector<float> host = on_device.to(Device::cpu()).to_vector<float>();
  load_balance = host.at(0);
  z_loss = host.at(1);
  device_balance = host.at(2);
  on_device = Tensor();
}

void resolve_all(std::vector<RouterLossValues>& values) {
  std::vector<RouterLossValues*> pending;
  for (RouterLossValues& v : values)
    if (v.on_device.defined()) pending.push_back(&v);
  if (pending.empty()) return;
  const Device device = pending.front()->on_device.device();
  const bool one_device = std::all_of(pending.begin(), pending.end(),
                                      [&](const RouterLossValues* v) { return v->on_device.device() == device; });
  if (one_device) {
    Tensor gathered = Tensor::empty({static_cast<int64_t>(pending.size()), 3}, DType::F32, device);
    for (size_t i = 0; i < pending.size(); ++i)
      gathered.select(static_cast<int64_t>(i)).copy_from(pending[i]->on_device);
    const std::vector<float> host = gathered.to(Device::cpu()).to_vector<float>();
    for (size_t i = 0; i < pending.size(); ++i) {
      pending[i]->load_balance = host[3 * i];
      pending[i]->z_loss = host[3 * i + 1];
      pending[i]->device_balance = host[3 * i + 2];
      pending[i]->on_device = Tensor();
    }
  }
  for (RouterLossValues* v : pending) v->resolve();  // a no-op once gathered above
}

RouterLossValues router_aux_losses(const RouterLossSettings& s, int64_t moe_layer, const Tensor& logits,
                                   const Tensor& probs, const Tensor& topk_index, const Tensor& cu_seqlens,
                                   Tensor& d_probs, Tensor& d_logits) {
  validate(s, moe_layer, logits, probs, topk_index, cu_seqlens);
  const Device device = logits.device();
  const int64_t T = logits.size(0), E = logits.size(1), K = topk_index.size(1);
  Tensor* running_counts = nullptr;
  if (s.load_balance_coef > 0.0 && s.variant == LoadBalanceVariant::GlobalBatch) {
    Tensor& running = (*s.running_counts)[static_cast<size_t>(moe_layer)];
    if (!running.defined()) running = Tensor::zeros({E}, DType::I32, device);
    expect_shape(running, {E}, "router loss: running expert counts");
    expect_dtype(running, DType::I32, "router loss: running expert counts");
    expect_contiguous(running, "router loss: running expert counts");
    expect_same_device(running, logits, "router loss: running expert counts");
    running_counts = &running;
  }
#if MOETRAIN_HAS_CUDA
  if (device.is_cuda()) {
    // No host synchronisation: zeros / empty are stream-ordered, the values stay on the device.
    RouterLossValues values;
    values.tokens = T;
    values.on_device = Tensor::empty({3}, DType::F32, device);
    d_probs = s.load_balance_coef > 0.0 || s.device_balance_coef > 0.0 ? Tensor::empty({T, E}, DType::F32, device)
                                                                       : Tensor::zeros({T, E}, DType::F32, device);
    d_logits =
        s.z_loss_coef > 0.0 ? Tensor::empty({T, E}, DType::F32, device) : Tensor::zeros({T, E}, DType::F32, device);
    ops::cuda::RouterAuxParams params;
    params.per_document = s.variant == LoadBalanceVariant::Sequence;
    params.use_running = running_counts != nullptr;
    params.load_balance_coef = s.load_balance_coef;
    params.z_loss_coef = s.z_loss_coef;
    params.device_balance_coef = s.device_balance_coef;
    params.device_groups = s.device_balance_groups;
    params.layer_scale = s.loss_scale / static_cast<double>(s.num_moe_layers);
    ops::cuda::router_aux_losses(default_stream(device), values.on_device, d_probs, d_logits, logits, probs, topk_index,
                                 cu_seqlens, running_counts ? *running_counts : Tensor(), params);
    return values;
  }
#endif
  MT_CHECK(device.is_cpu(), "router loss: no backend for the router's tensors on {} (a build without CUDA)",
           device.str());
  const float* p = probs.data<float>();
  const float* z = logits.data<float>();
  const int32_t* idx = topk_index.data<int32_t>();
  for (int64_t i = 0; i < T * K; ++i) {
    MT_CHECK(idx[i] >= 0 && idx[i] < E, "router loss: topk_index[{}][{}] = {} is outside [0, E = {})", i / K, i % K,
             idx[i], E);
  }
  const double layer_scale = s.loss_scale / static_cast<double>(s.num_moe_layers);
  RouterLossValues values;
  values.tokens = T;
  d_probs = Tensor::zeros({T, E}, DType::F32);
  d_logits = Tensor::zeros({T, E}, DType::F32);

  // Both balance terms of d_probs are added in f64 and rounded to f32 once (as the CUDA kernel does).
  std::vector<double> grad;
  if (s.load_balance_coef > 0.0 || s.device_balance_coef > 0.0) grad.assign(static_cast<size_t>(T * E), 0.0);
  if (s.load_balance_coef > 0.0) {
    std::vector<double> global_fraction;
    if (running_counts != nullptr) {
      int32_t* running = running_counts->data<int32_t>();
      for (int64_t i = 0; i < T * K; ++i) running[idx[i]] += 1;
      double total = 0.0;
      for (int64_t e = 0; e < E; ++e) total += static_cast<double>(running[e]);
      for (int64_t e = 0; e < E; ++e) global_fraction.push_back(static_cast<double>(running[e]) / total);
    }
    for (const Segment& set : balance_sets(s.variant, cu_seqlens, T)) {
      const int64_t n = set.end - set.begin;
      SetStatistics st = set_statistics(p, idx, set, E, K);
      std::vector<double>& fraction = st.fraction;
      const std::vector<double>& mean_prob = st.mean_prob;
      if (!global_fraction.empty()) fraction = global_fraction;
      double value = 0.0;
      for (int64_t e = 0; e < E; ++e) value += static_cast<double>(E) * fraction[e] * mean_prob[e];
      values.load_balance += value * static_cast<double>(n) / static_cast<double>(T);
      // d(coef * n * value * layer_scale) / d p[t, e] = coef * E * f_e * layer_scale (the 1/n of P cancels n).
      for (int64_t t = set.begin; t < set.end; ++t) {
        for (int64_t e = 0; e < E; ++e) {
          grad[t * E + e] = s.load_balance_coef * static_cast<double>(E) * fraction[e] * layer_scale;
        }
      }
    }
  }
  if (s.device_balance_coef > 0.0) {
    // The micro-batch's f_e and P_e by the micro_batch variant's expressions, summed over each group of E / D
    // consecutive experts (in ascending order): with D = E the groups are the experts and every bit is that variant's.
    const SetStatistics st = set_statistics(p, idx, {0, T}, E, K);
    const int64_t D = s.device_balance_groups, per_group = E / D;
    std::vector<double> group_fraction(static_cast<size_t>(D), 0.0), group_prob(static_cast<size_t>(D), 0.0);
    for (int64_t e = 0; e < E; ++e) {
      group_fraction[e / per_group] += st.fraction[e];
      group_prob[e / per_group] += st.mean_prob[e];
    }
    for (int64_t i = 0; i < D; ++i) {
      values.device_balance += static_cast<double>(D) * group_fraction[i] * group_prob[i];
    }
    // d(coef * T * value * layer_scale) / d p[t, e] = coef * D * F_group(e) * layer_scale (the 1/T of P cancels T).
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        grad[t * E + e] += s.device_balance_coef * static_cast<double>(D) * group_fraction[e / per_group] * layer_scale;
      }
    }
  }
  if (!grad.empty()) {
    float* dp = d_probs.data<float>();
    for (int64_t i = 0; i < T * E; ++i) dp[i] = static_cast<float>(grad[i]);
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
