// defines: the CUDA launcher of the router's auxiliary losses (model/router_loss.h): per-expert selection counts
// and mean probabilities per balance set, the load-balance value and its gradient on the probabilities, the
// device-level balance value (DeepSeek-V2) and its gradient on the probabilities, the z-loss value and its gradient
// on the logits, with the values left on the device (no host synchronisation).
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

struct RouterAuxParams {
  bool per_document = false;         // sequence variant: one balance set per document of cu_seqlens; else one set
  bool use_running = false;          // global_batch: fractions from running_counts after adding this micro-batch
  double load_balance_coef = 0.0;    // 0: no load balance (value 0, no gradient term)
  double z_loss_coef = 0.0;          // 0: no z-loss (d_logits untouched, value 0)
  double device_balance_coef = 0.0;  // 0: no device balance (value 0, no gradient term)
  int64_t device_groups = 1;         // D: groups of E / D consecutive experts (D divides E)
  double layer_scale = 0.0;          // loss_scale / num_moe_layers
};

// The caller (model::router_aux_losses) validates: logits, probs f32 [T, E]; topk_index i32 [T, K] with values in
// [0, E) (not checkable without a host copy: the router's output always is); cu_seqlens i32 [documents + 1]
// with cu[0] = 0, non-decreasing, cu[documents] = T (used only when per_document); running_counts i32 [E] (only when
// use_running; updated in place: += this micro-batch's selections); values f32 [3] = (load balance, z-loss,
// device balance); d_probs f32 [T, E], written when the load-balance or the device-balance coefficient is > 0 (the
// sum of both terms, added in f64 before the one rounding to f32); d_logits f32 [T, E], written only when the
// z-loss coefficient is > 0. Everything is on one CUDA device. All sums run in f64 in an order fixed by the reduced
// length alone (no float atomics), so the results are deterministic and a document's statistics do not depend on
// the other documents. The gradients are computed with the same f64 expressions as the CPU path, e.g.
// coef * E * f_e * layer_scale + device_coef * D * F_group(e) * layer_scale.
void router_aux_losses(const Stream& stream, const Tensor& values, const Tensor& d_probs, const Tensor& d_logits,
                       const Tensor& logits, const Tensor& probs, const Tensor& topk_index, const Tensor& cu_seqlens,
                       const Tensor& running_counts, const RouterAuxParams& params);

}  // namespace moetrain::ops::cuda
