// defines: generate, autoregressive decoding with a KV cache through the one layer driver (pipeline/stage_chunk.h): a
// prefill of the prompts, then one token per sequence per step, each step's layers reading and extending the
// model::DecodeCache its batch carries. Each sampled token's log-prob comes from the job's own head program (the fused
// head with the sampled token as target), the quantity `score` reports, so in exact mode, where every op is
// batch-invariant, the two are the same bytes (docs/generation.md).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/causal_lm.h"

namespace moetrain::pipeline {

struct GenerationRequest {
  Tensor input_ids;              // i32 [B, P] on the CPU; row b's prompt is its first lengths[b] tokens
  std::vector<int32_t> lengths;  // [B], each in [1, P]
  int64_t max_new_tokens = 1;    // N >= 1
  double temperature = 0.0;      // 0: greedy (the first of equal maxima); > 0: sample from softmax(logits / T)
  uint64_t seed = 0;             // sampling: row b draws from its own stream (Rng::for_key(seed, "generate.row<b>"))
};

struct Generation {
  Tensor tokens;    // i32 [B, P + N]: each row's prompt, then its N sampled tokens, then -1 up to P + N
  Tensor logprobs;  // f32 [B, N]: log p(sampled token | its prefix) under the model, before temperature
};

// Validates the request against the model (generate's first step): input_ids and lengths, token ids in its
// vocabulary, max_new_tokens, temperature, every layer able to decode (the error names the first that is not, and
// why).
void validate_generation(const model::CausalLm& model, const GenerationRequest& request);
// validate_generation, then the decoding on the model's device. Single rank.
Generation generate(const model::CausalLm& model, const GenerationRequest& request);

// The token a row of logits (f32 [V] on the CPU) gives: the first maximum at temperature 0, else a draw from
// softmax(logits / temperature) by inverse transform of `uniform` in [0, 1) (in double, ascending token order).
int32_t pick_token(const float* logits, int64_t vocab, double temperature, double uniform);

}  // namespace moetrain::pipeline
