// defines: CausalLm, a whole decoder-only model: its parameters, the prolog (token embedding), the decoder layers its
// family builds, and the epilog (final norm, LM head, cross-entropy), whose two forms (the fused, vocabulary-chunked
// head and materialised logits) are chosen in one place, head_forward. The drivers that run it over micro-batches
// live in pipeline/ (one layer driver for every executor). In exact mode (set_exact) the hidden state is rounded to
// bf16 at every layer boundary (docs/design.md section 6).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/batch.h"
#include "model/decoder_layer.h"
#include "model/model_config.h"
#include "model/parameter_store.h"
#include "ops/linear_cross_entropy.h"
#include "ops/norm.h"

namespace moetrain::io {
class SafetensorsReader;
}  // namespace moetrain::io

namespace moetrain::model {

struct EpilogRecord {
  Tensor hidden, rstd, normed;  // final norm input, its rstd, its output
  Tensor logits, lse,
      losses;  // [T, V] (undefined after a fused forward; their gradient after backward_input), [T], [T]
  const MicroBatch* batch = nullptr;
  Tensor d_normed;  // the final norm's output gradient, until backward_input; made by a fused forward with a loss scale
  // Set by a fused head_forward with loss_scale > 0: d_normed exists and the head's weight gradient is accumulated.
  bool fused = false;
  // Set by a materialised head_forward with loss_scale > 0 whose logits the caller does not keep: `logits` holds
  // their gradient already.
  bool logits_hold_gradient = false;
  double loss_scale = 0.0;  // the scale the forward's gradients were made for (fused or logits_hold_gradient)
};

// A micro-batch's cross-entropy sum and counted targets. On CUDA head_forward leaves them on the device
// (ops::cross_entropy_totals_pending) so that the host does not wait for the GPU inside a step; resolve_losses reads a
// step's in one copy. On the CPU they are read at once and nothing is pending. Reading a sum that is still pending
// fails, naming the missing resolve_losses, where it would otherwise read as zero.
class LossSum {
 public:
  LossSum() = default;  // an empty sum (a stage without the head), resolved
  // The f64 [2] {sum, count} that head_forward left on the device, to be read by resolve_losses.
  static LossSum pending_on_device(Tensor totals);

  bool resolved() const { return !pending_.defined(); }
  Device pending_device() const { return pending_.device(); }  // while pending
  double ce_sum() const;
  int64_t num_targets() const;

  // Reads the pending sums of `losses` on `stream` in one copy (each must be pending).
  static void read(Stream& stream, const std::vector<LossSum*>& losses);

 private:
  double ce_sum_ = 0.0;
  int64_t num_targets_ = 0;
  Tensor pending_;  // f64 [2] = {sum, count} still to be read; undefined once read
};
// Reads every pending sum of `losses` (one wait for the device, none when nothing is pending).
void resolve_losses(std::vector<LossSum>& losses);

class CausalLm {
 public:
  // Zero parameters of the layout `config` implies; activations in `compute_dtype` (f32, or bf16
  // on CUDA with fp32 masters: see ParameterStore).
  explicit CausalLm(const ModelConfig& config, Device device = Device::cpu(), DType compute_dtype = DType::F32);
  // An exact model lets go of its hold on the batch-invariant policy.
  ~CausalLm();
  CausalLm(const CausalLm&) = delete;
  CausalLm& operator=(const CausalLm&) = delete;
  // A Hugging Face model folder: config.json and its safetensors (single file or sharded).
  static std::unique_ptr<CausalLm> from_hf(const std::string& dir, Device device = Device::cpu(),
                                           DType compute_dtype = DType::F32);

  // Loads the weights of a Hugging Face checkpoint, each tensor under the name its family reads it by
  // (Family::checkpoint_tensor_name: a multimodal checkpoint's text model); the tensors the family leaves out are
  // counted by prefix in a log line. Every other check is ParameterStore::load_hf_tensors'.
  void load_hf_weights(const io::SafetensorsReader& reader);

  const ModelConfig& config() const { return config_; }
  ParameterStore& params() { return *params_; }
  const ParameterStore& params() const { return *params_; }
  const std::vector<std::unique_ptr<DecoderLayer>>& layers() const { return layers_; }
  Device device() const { return device_; }
  DType compute_dtype() const { return params_->compute_dtype(); }
  // The residual stream's dtype: the hidden state between layers (the embedding's output, each layer's input and
  // output, what a pipeline stage sends) and its gradient. The compute dtype by default (Megatron-Core's and
  // torchtitan's bf16 stream); f32 under bf16 compute keeps the stream as autocast does (Megatron-Core's
  // fp32_residual_connection): each norm reads f32 and writes bf16, each residual add sums into f32, and the
  // stream's gradient is summed in f32 across the layers, and an untied embedding is read from its fp32 master (as
  // autocast reads the fp32 weight). Set before the first forward, and before an optimizer or ZeRO-3 takes the
  // parameters (ParameterStore::set_compute_in_f32).
  DType stream_dtype() const { return stream_dtype_; }
  void set_stream_dtype(DType dtype);
  // Every gated MLP (dense, experts, shared expert) recomputes its activation in the backward instead of keeping it
  // through the step (model.recompute = activation): the same bits, one [R, I] tensor less per layer in flight, one
  // activation kernel more per layer. Set before the first forward.
  void set_recompute_activation(bool on);
  bool recompute_activation() const { return recompute_activation_; }

  // The exact program (docs/design.md section 6): when on, the f32 hidden state is rounded to bf16
  // values after the embedding and after every decoder layer, i.e. at every boundary where a
  // pipeline may cut, so the wire between stages is the same program whatever the cut; within a
  // layer the math stays f32. The backward passes gradients straight through the rounding. A bf16
  // hidden state (CUDA bf16 compute) is already on the bf16 grid. While on, the model holds its device stream under
  // the batch-invariant kernel policy (KernelPolicy, core/device.h), so that every op runs a kernel whose bytes for a
  // token do not depend on the batch (the CPU's always do). Off by default.
  void set_exact(bool exact);
  bool exact() const { return exact_; }
  // Rounds `hidden` to the bf16 grid in place when exact mode is on (and it is f32); else nothing.
  void round_boundary(Tensor& hidden) const;

  // Prolog: hidden [T, H] = embedding of the batch's tokens.
  Tensor embed_forward(const MicroBatch& batch) const;
  void embed_backward(const MicroBatch& batch, const Tensor& d_hidden) const;

  // Epilog forward: the final norm, the head and the per-token cross-entropy. The one place the head's form is chosen:
  // the fused head (ops/linear_cross_entropy.h, head_chunk() columns at a time, the [T, V] logits never exist) unless
  // the head chunk is 0 or the caller wants the logits (`keep_logits`: they stay in record.logits). The fused head
  // with loss_scale > 0 (1 / the step's global target count) produces its gradients at once: d_normed is kept in the
  // record and the head's weight gradient accumulated now; loss_scale == 0 is forward only (no backward may follow).
  // The materialised head with loss_scale > 0 and logits not kept replaces the logits with their gradient in the
  // loss's own pass (ops::cross_entropy_forward_backward); its backward must then ask for the same scale. On CUDA the
  // returned sum is pending: reading its ce_sum or num_targets before resolve_losses fails.
  LossSum head_forward(EpilogRecord& record, const Tensor& hidden, const MicroBatch& batch, double loss_scale,
                       bool keep_logits = false) const;
  // Whether head_forward would run the fused head.
  bool head_is_fused(bool keep_logits) const { return head_chunk_ > 0 && !keep_logits; }
  // d_hidden for d(loss)/d(ce_sum) = loss_scale (the same scale a fused forward was given).
  Tensor head_backward_input(EpilogRecord& record, double loss_scale) const;
  void head_backward_weight(EpilogRecord& record) const;
  // Vocabulary columns per chunk of the fused head; 0 materialises the logits.
  void set_head_chunk(int64_t columns);
  int64_t head_chunk() const { return head_chunk_; }

 private:
  // The head's weight (the embedding's when tied) and the final norm's, by their roles.
  Tensor head_weight() const;
  Tensor head_grad() const;
  Tensor final_norm_weight() const;
  Tensor final_norm_grad() const;

  ModelConfig config_;
  Device device_;
  std::unique_ptr<ParameterStore> params_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  ops::RmsNormParams final_norm_;
  bool exact_ = false;
  DType stream_dtype_;
  bool recompute_activation_ = false;
  int64_t head_chunk_ = ops::kLinearCrossEntropyChunk;
  // An untied head's weight gradient, left to its first write of a step (the materialised head's GEMM overwrites; the
  // fused head, which adds chunk by chunk, zeroes it first). A tied head shares the embedding's, which its scatter
  // adds to: not registered.
  GradientWriter head_writer_;
};

// What a caller may want to look at besides the loss (check-golden, tests): filled by the executors' drivers.
struct ForwardObservation {
  // Whether to keep the logits: the head then materialises them (the fused head never holds them whole), a
  // different program from the job's when the vocabulary spans several head chunks. Off: token log-probs and router
  // logits only, from the job's own program.
  bool keep_logits = true;
  std::vector<Tensor> logits;                      // per micro-batch, [T, V] (with keep_logits)
  std::vector<std::vector<Tensor>> router_logits;  // per micro-batch, per MoE layer, [T, E]
  // Per micro-batch, f32 [T] on the CPU: log p(target[t]) = -(cross-entropy of token t); +0.0f
  // (never -0.0f) where the target is ignored (-100), e.g. at the end of a document.
  std::vector<Tensor> token_logprobs;
};

// The loss of one training step (or forward pass) as the executors report it.
struct StepLoss {
  double loss = 0.0;  // ce_sum / the step's denominator (the global target count when given)
  double ce_sum = 0.0;
  int64_t num_targets = 0;
  // Auxiliary router losses when the batches ask for them: token-weighted over the micro-batches
  // and averaged over the MoE layers; load_balance and device_balance are 1.0 when perfectly balanced.
  double load_balance = 0.0;
  double z_loss = 0.0;
  double device_balance = 0.0;  // DeepSeek-V2's device-level balance (0 when off)
  int64_t num_tokens = 0;
  // The load balance of each MoE layer in layer order (as load_balance, not averaged over the layers): token-weighted
  // over the micro-batches. Empty for a dense model or when the router losses were not computed.
  std::vector<double> layer_load_balance;
};

// The per-token log-probs of one micro-batch from its per-token losses (any device) and targets: f32 [T] on the CPU,
// log p(target[t]) = -(cross-entropy of token t); +0.0f (never -0.0f) where the target is ignored (-100).
Tensor token_logprobs_from_losses(const Tensor& losses, const Tensor& targets);

}  // namespace moetrain::model
