// defines: CausalLm, a whole decoder-only model: its parameters, the prolog (token embedding),
// the decoder layers, and the epilog (final norm, LM head, cross-entropy). forward_backward runs
// it over a list of micro-batches with the token-weighted loss of DESIGN.md section 1: the sum of
// cross-entropy over every counted target of the step divided by their number. In exact mode
// (set_exact) the hidden state is rounded to bf16 at every layer boundary (DESIGN.md section 6).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/model_config.h"
#include "model/batch.h"
#include "model/decoder_layer.h"
#include "model/parameter_store.h"
#include "ops/linear_cross_entropy.h"
#include "ops/norm.h"

namespace moetrain::model {

struct EpilogRecord {
  Tensor hidden, rstd, normed;  // final norm input, its rstd, its output
  Tensor logits, lse, losses;   // [T, V] (undefined after a fused forward), [T], [T]
  const MicroBatch* batch = nullptr;
  Tensor d_normed;  // kept by backward_input for backward_weight; made by a fused forward with a loss scale
  // Set by head_forward_fused with loss_scale > 0: d_normed exists and the head's weight gradient is accumulated.
  bool fused = false;
  double loss_scale = 0.0;
};

struct LossSum {
  double ce_sum = 0.0;
  int64_t num_targets = 0;
};

class CausalLm {
 public:
  // Zero parameters of the layout `config` implies; activations in `compute_dtype` (f32, or bf16
  // on CUDA with fp32 masters: see ParameterStore).
  explicit CausalLm(const io::ModelConfig& config, Device device = Device::cpu(), DType compute_dtype = DType::F32);
  // A Hugging Face model folder: config.json and its safetensors (single file or sharded).
  static std::unique_ptr<CausalLm> from_hf(const std::string& dir, Device device = Device::cpu(),
                                           DType compute_dtype = DType::F32);

  const io::ModelConfig& config() const { return config_; }
  ParameterStore& params() { return *params_; }
  const ParameterStore& params() const { return *params_; }
  const std::vector<std::unique_ptr<DecoderLayer>>& layers() const { return layers_; }
  Device device() const { return device_; }
  DType compute_dtype() const { return params_->compute_dtype(); }

  // The exact program (DESIGN.md section 6): when on, the f32 hidden state is rounded to bf16
  // values after the embedding and after every decoder layer, i.e. at every boundary where a
  // pipeline may cut, so the wire between stages is the same program whatever the cut; within a
  // layer the math stays f32. The backward passes gradients straight through the rounding. A bf16
  // hidden state (CUDA bf16 compute) is already on the bf16 grid. Off by default.
  void set_exact(bool exact) { exact_ = exact; }
  bool exact() const { return exact_; }
  // Rounds `hidden` to the bf16 grid in place when exact mode is on (and it is f32); else nothing.
  void round_boundary(Tensor& hidden) const;

  // Prolog: hidden [T, H] = embedding of the batch's tokens.
  Tensor embed_forward(const MicroBatch& batch) const;
  void embed_backward(const MicroBatch& batch, const Tensor& d_hidden) const;

  // Epilog: final norm, head, per-token cross-entropy; the logits stay in the record.
  LossSum head_forward(EpilogRecord& record, const Tensor& hidden, const MicroBatch& batch) const;
  // d_hidden for d(loss)/d(ce_sum) = loss_scale (1 / the step's global target count).
  Tensor head_backward_input(EpilogRecord& record, double loss_scale) const;
  void head_backward_weight(EpilogRecord& record) const;
  // Fused epilog: final norm, then the head and the cross-entropy chunked over the vocabulary
  // (ops/linear_cross_entropy.h, head_chunk() columns at a time): the [T, V] logits never exist. With
  // loss_scale > 0 (1 / the step's global target count) the gradients come at once: d_normed is kept in the
  // record and the head's weight gradient is accumulated now; head_backward_input (same loss_scale) and
  // head_backward_weight then only finish the final norm's backward. loss_scale == 0: forward only.
  LossSum head_forward_fused(EpilogRecord& record, const Tensor& hidden, const MicroBatch& batch,
                             double loss_scale) const;
  // Vocabulary columns per chunk of the fused head; 0 makes forward_backward / forward_only materialise the logits
  // (head_forward). They do so anyway when the caller observes the logits.
  void set_head_chunk(int64_t columns) { head_chunk_ = columns; }
  int64_t head_chunk() const { return head_chunk_; }

 private:
  io::ModelConfig config_;
  Device device_;
  std::unique_ptr<ParameterStore> params_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  ops::RmsNormParams final_norm_;
  bool exact_ = false;
  int64_t head_chunk_ = ops::kLinearCrossEntropyChunk;
};

// What a caller may want to look at besides the loss (check-golden, tests).
struct ForwardObservation {
  std::vector<Tensor> logits;                      // per micro-batch, [T, V]
  std::vector<std::vector<Tensor>> router_logits;  // per micro-batch, per MoE layer, [T, E]
  // Per micro-batch, f32 [T] on the CPU: log p(target[t]) = -(cross-entropy of token t); +0.0f
  // (never -0.0f) where the target is ignored (-100), e.g. at the end of a document.
  std::vector<Tensor> token_logprobs;
};

// The per-token log-probs of one micro-batch from its per-token losses (any device) and targets.
Tensor token_logprobs_from_losses(const Tensor& losses, const Tensor& targets);

struct StepLoss {
  double loss = 0.0;  // ce_sum / num_targets
  double ce_sum = 0.0;
  int64_t num_targets = 0;
  // Auxiliary router losses when the batches ask for them: token-weighted over the micro-batches
  // and averaged over the MoE layers; load_balance is 1.0 when perfectly balanced.
  double load_balance = 0.0;
  double z_loss = 0.0;
  int64_t num_tokens = 0;
  // Router-loss values still on the device, summed into the fields above with one wait when the
  // step's forward passes are done (CUDA keeps them there so no layer waits for the stream).
  std::vector<RouterLossValues> pending_router_losses;
};

// Forward and backward of every micro-batch in order, accumulating into the parameter gradients
// (which the caller zeroes). The loss scale is 1 / the targets counted over all the micro-batches,
// or 1 / global_num_targets when that is given (> 0: the count over every data-parallel rank).
StepLoss forward_backward(const CausalLm& model, const std::vector<MicroBatch>& batches, int64_t global_num_targets = 0,
                          ForwardObservation* observe = nullptr);

// Forward only (no records kept past each layer); fills `observe` when given.
StepLoss forward_only(const CausalLm& model, const std::vector<MicroBatch>& batches,
                      ForwardObservation* observe = nullptr);

}  // namespace moetrain::model
