// defines: MicroBatch, one flat run of tokens with its document boundaries. Packed is the general
// case: a fixed window of B rows of T tokens is cu_seqlens = [0, T, 2T, ..., BT], so the same
// kernels and numerics serve both (docs/design.md section 4).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moetrain::model {

struct RouterLossSettings;
class DecodeCache;

struct MicroBatch {
  Tensor input_ids;        // i32 [T]
  Tensor targets;          // i32 [T]; -100 = not counted in the loss
  Tensor position_ids;     // i32 [T]; restart at 0 in every document
  Tensor cu_seqlens;       // i32 [D + 1]; document d is tokens [cu[d], cu[d + 1])
  Tensor cu_seqlens_host;  // the same on the CPU (host-side logic never reads device memory)
  // The step's auxiliary router losses (load balance, z-loss); null: none (the HF reference).
  const RouterLossSettings* router_loss = nullptr;
  // Routing pinned to another run's (check-golden's diagnostic, cli/check_golden.cpp): per MoE layer in order, router
  // logits [T, E] of that run (f32, or f64 on the CPU in f64 models: the router's statistics dtype; on the model's
  // device). Each router selects its experts from them by its own rule and weighs those experts from its own logits
  // (ops::router_forward_given). Null: every router selects from its own logits (training, scoring).
  const std::vector<Tensor>* pinned_routing = nullptr;
  // A generation call (model/decode_cache.h): the token mixers read and extend this cache. Null: training, scoring.
  DecodeCache* decode = nullptr;

  int64_t num_tokens() const { return input_ids.numel(); }
  int64_t num_documents() const { return cu_seqlens.numel() - 1; }
  // Number of targets that count (!= -100); counted on the host when the batch is made.
  int64_t num_targets() const { return num_targets_; }
  // The longest document, read from the host copy of cu_seqlens (0 when there is none): kernels
  // that plan by document length (cuDNN's attention) need it without reading device memory.
  int64_t max_document_length() const;
  Device device() const { return input_ids.device(); }

  // B rows of T tokens, each row one document: input_ids and targets i32 [B, T].
  static MicroBatch from_rows(const Tensor& input_ids, const Tensor& targets);
  // Documents packed into one run; positions restart at each cu_seqlens boundary.
  static MicroBatch packed(const Tensor& input_ids, const Tensor& targets, const Tensor& cu_seqlens);
  // A generation step: token t (input_ids i32 [B]) is the newest of sequence t, at position_ids[t] (i32 [B], >= 0);
  // its earlier tokens live in the DecodeCache the caller sets. Each token is a document of its own for every op but
  // the cached attention; no targets.
  static MicroBatch decode_step(const Tensor& input_ids, const Tensor& position_ids);

  // Fails closed on anything a kernel would misread: dtypes, shapes, cu_seqlens rules, positions
  // that do not restart per document, ids or targets outside the vocabulary.
  void validate(int64_t vocab_size) const;

  // The batch with its tensors on `device` (the same tensors when already there); the host copy
  // of cu_seqlens and the target count travel along.
  MicroBatch to(Device device) const;

 private:
  int64_t num_targets_ = 0;
};

// Every batch's tensors on `device` in one host-to-device copy (each tensor a view of one buffer, at a 256-byte
// boundary), for a step that uploads its micro-batches together rather than one copy, and one wait for the device,
// per tensor and micro-batch. Batches already on `device` (the CPU included) are returned as they are.
std::vector<MicroBatch> to_device(const std::vector<MicroBatch>& batches, Device device);

}  // namespace moetrain::model
