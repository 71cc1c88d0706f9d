// defines: the router's auxiliary losses: load balancing (micro-batch, global-batch and sequence
// variants), DeepSeek-V2's device-level balance and the router z-loss. All are token-weighted like the
// cross-entropy: a micro-batch of T tokens adds T * (its per-token value) and the step divides by the
// same global count N as the cross-entropy, so its gradient is injected at the router already scaled by
// 1/N. Values are averaged over the MoE layers and normalised so that 1.0 means perfectly balanced.
//
//   load balance of a set S of tokens: E * sum_e f_e * P_e, with f_e the fraction of the |S| * K
//   choices that picked expert e and P_e the mean router probability of e over S.
//   micro_batch: S = the micro-batch; sequence: S = each document of it (DeepSeek-V3's
//   sequence-wise loss); global_batch: f_e from every micro-batch of the step seen so far
//   (Megatron-Core's global aux loss: on the step's last micro-batch f is the whole batch's),
//   P_e still from the micro-batch.
//   device balance (DeepSeek-V2, section 2.2): the E experts in D groups of E / D consecutive experts (one per
//   expert-parallel rank: dist/expert_parallel.h places experts so), S = the micro-batch:
//   D * sum_i F_i * Pdev_i, with F_i the fraction of the |S| * K choices that picked an expert of group i and
//   Pdev_i = sum over the group's experts of P_e. It is the paper's alpha2 * sum_i f'_i * P'_i divided by alpha2
//   (f'_i = E / (K T) * choices of group i / |E_i| = D * F_i); with D = E it is the micro_batch load balance and
//   with D = 1 it is sum_e P_e (1 when each token's probabilities sum to 1, whatever the routing).
//   z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moetrain::model {

enum class LoadBalanceVariant : uint8_t { MicroBatch, GlobalBatch, Sequence };
LoadBalanceVariant parse_load_balance_variant(const std::string& name);

// Per step: set by the trainer once it knows the step's global target count.
struct RouterLossSettings {
  LoadBalanceVariant variant = LoadBalanceVariant::MicroBatch;
  double load_balance_coef = 0.0;
  double z_loss_coef = 0.0;
  double device_balance_coef = 0.0;   // 0: no device-level balance loss
  int64_t device_balance_groups = 1;  // D: must divide E when device_balance_coef > 0
  double loss_scale = 0.0;            // 1 / the step's global count of counted targets
  int64_t num_moe_layers = 1;         // values and gradients are averaged over these
  // global_batch: selections per expert accumulated over the step, one i32 [E] tensor per MoE layer
  // (indexed by the layer's position among MoE layers), on the device of the router's tensors: an
  // undefined entry is created (zeros) by the layer's first micro-batch; the trainer clears the
  // entries at each step (assign(num_moe_layers, {})). On CUDA the counts never leave the device.
  std::vector<Tensor>* running_counts = nullptr;

  bool active() const { return load_balance_coef > 0.0 || z_loss_coef > 0.0 || device_balance_coef > 0.0; }
};

// What one MoE layer's router contributed for one micro-batch.
struct RouterLossValues {
  double load_balance = 0.0;  // this layer's normalised value (1.0 = balanced), token-weighted over the micro-batch
  double z_loss = 0.0;
  double device_balance = 0.0;  // normalised like load_balance (1.0 = balanced over the groups)
  int64_t tokens = 0;
  // On CUDA the values stay on the device, f32 [3] = (load_balance, z_loss, device_balance), until resolve()
  // copies them into the doubles above: call it where the host needs them, as late as possible
  // (a copy waits for the stream). Undefined when the doubles already hold the values.
  Tensor on_device;
  void resolve();
};

// Resolves every value with one wait: the device triples are gathered (stream-ordered copies) and copied to the host
// once, so a step's forward passes never wait for the stream layer by layer.
void resolve_all(std::vector<RouterLossValues>& values);

// The number of device groups D of the device-level balance loss: `configured` (loss.device_balance_groups) when
// > 0, else the run's expert-parallel degree `ep_size`. Refused: D < 1, or D not dividing `num_experts` when the
// model has experts (the error names both and the key to change).
int64_t resolve_device_balance_groups(int64_t configured, int64_t ep_size, int64_t num_experts);

// Computes the values and the gradients to inject: d_probs [T, E] on the router probabilities
// (load balance plus device balance) and d_logits [T, E] on the router logits (z-loss), each term already
// multiplied by its coef * loss_scale / num_moe_layers. `moe_layer` is the layer's index among the MoE layers.
// logits, probs f32 [T, E], topk_index i32 [T, K] and cu_seqlens i32 [documents + 1] live on one device.
// CPU: host math, the values in the doubles. CUDA (ops/cuda/router_aux.h): device kernels, no host
// synchronisation; the values are left in `on_device` (call resolve() before reading them), and
// cu_seqlens must be the device copy (its values are not checked there: MicroBatch::validate did).
RouterLossValues router_aux_losses(const RouterLossSettings& settings, int64_t moe_layer, const Tensor& logits,
                                   const Tensor& probs, const Tensor& topk_index, const Tensor& cu_seqlens,
                                   Tensor& d_probs, Tensor& d_logits);

}  // namespace moetrain::model
