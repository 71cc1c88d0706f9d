// defines: generate (pipeline/generation.h): request validation, the prefill and the decoding steps through one
// StageChunk over the whole model without its head, and each step's choice and log-prob from the model's head.
#include "pipeline/generation.h"

#include <climits>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"
#include "model/batch.h"
#include "model/decode_cache.h"
#include "ops/loss.h"
#include "ops/row_gather.h"
#include "pipeline/partition.h"
#include "pipeline/stage_chunk.h"

namespace moetrain::pipeline {

namespace {

// Every decoder layer after the embedding; the head runs here, twice a step (generation_step).
StageLayers layers_without_head(const model::CausalLm& model) {
  StageLayers stage;
  stage.first_layer = 0;
  stage.end_layer = static_cast<int64_t>(model.layers().size());
  stage.has_embedding = true;
  return stage;
}

struct StepChoice {
  std::vector<int32_t> tokens;
  Tensor logprobs;  // f32 [B] on the CPU
};

// The next token of every sequence from the hidden rows [B, H] of its newest token: the choice from the materialised
// logits, the log-prob from the head the job runs (fused unless the model's head chunk is 0), as score computes it.
StepChoice choose(const model::CausalLm& model, const Tensor& newest, double temperature, std::vector<Rng>& rngs) {
  const int64_t rows = newest.size(0), vocab = model.config().vocab_size;
  const Tensor zeros = Tensor::zeros({rows}, DType::I32);
  model::MicroBatch head = model::MicroBatch::decode_step(zeros, zeros);
  model::EpilogRecord choice;
  model.head_forward(choice, newest, head.to(model.device()), 0.0, /*keep_logits=*/true);
  Tensor logits = choice.logits.to(Device::cpu());
  if (logits.dtype() != DType::F32) logits = logits.to(DType::F32);
  StepChoice out;
  for (int64_t b = 0; b < rows; ++b) {
    const double uniform = temperature > 0.0 ? rngs[static_cast<size_t>(b)].uniform() : 0.0;
    out.tokens.push_back(pick_token(logits.data<float>() + b * vocab, vocab, temperature, uniform));
  }
  head.targets = Tensor::from_vector(out.tokens, {rows});
  model::EpilogRecord scored;
  const model::MicroBatch scored_batch = head.to(model.device());
  model.head_forward(scored, newest, scored_batch, 0.0, /*keep_logits=*/false);
  out.logprobs = model::token_logprobs_from_losses(scored.losses, scored_batch.targets);
  return out;
}

}  // namespace

void validate_generation(const model::CausalLm& model, const GenerationRequest& request) {
  const Tensor& ids = request.input_ids;
  MT_CHECK(ids.defined() && ids.dtype() == DType::I32 && ids.dim() == 2 && ids.device().is_cpu() && ids.is_contiguous(),
           "generate: input_ids must be a contiguous int32 [B, P] tensor on the CPU but is {}",
           ids.defined() ? ids.describe() : std::string("missing"));
  const int64_t rows = ids.size(0), width = ids.size(1);
  MT_CHECK(rows >= 1 && width >= 1, "generate: input_ids must hold at least one row of one token but is {}",
           ids.describe());
  MT_CHECK(static_cast<int64_t>(request.lengths.size()) == rows,
           "generate: expected {} prompt lengths (one per row of input_ids) but found {}", rows,
           request.lengths.size());
  MT_CHECK(request.max_new_tokens >= 1, "generate: max_new_tokens must be >= 1 but is {}", request.max_new_tokens);
  MT_CHECK(request.max_new_tokens <= INT32_MAX - width,
           "generate: P + max_new_tokens = {} + {} exceeds 2^31 - 1 tokens per row", width, request.max_new_tokens);
  MT_CHECK(std::isfinite(request.temperature) && request.temperature >= 0.0,
           "generate: temperature must be finite and >= 0 (0: greedy) but is {}", request.temperature);
  const int64_t vocab = model.config().vocab_size;
  const int32_t* id = ids.data<int32_t>();
  for (int64_t b = 0; b < rows; ++b) {
    const int32_t len = request.lengths[static_cast<size_t>(b)];
    MT_CHECK(len >= 1 && len <= width, "generate: lengths[{}] = {} must be in [1, P = {}]", b, len, width);
    for (int64_t t = 0; t < len; ++t) {
      const int32_t token = id[b * width + t];
      MT_CHECK(token >= 0 && token < vocab, "generate: input_ids[{}, {}] = {} is outside the vocabulary [0, {})", b, t,
               token, vocab);
    }
  }
  for (const auto& layer : model.layers()) {
    const std::string missing = layer->decoding_support();
    MT_CHECK(missing.empty(), "generate: {} cannot be decoded: decoder layer {}: {}", model.config().model_type,
             layer->index(), missing);
  }
}

int32_t pick_token(const float* logits, int64_t vocab, double temperature, double uniform) {
  MT_CHECK(vocab >= 1, "generate: a row of {} logits", vocab);
  int64_t best = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    MT_CHECK(std::isfinite(logits[i]), "generate: logit {} of the row is {}, not finite", i, logits[i]);
    if (logits[i] > logits[best]) best = i;
  }
  if (temperature == 0.0) return static_cast<int32_t>(best);
  MT_CHECK(uniform >= 0.0 && uniform < 1.0, "generate: a uniform draw must lie in [0, 1) but is {}", uniform);
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += std::exp((double(logits[i]) - double(logits[best])) / temperature);
  const double target = uniform * total;
  double cumulative = 0.0;
  int64_t last_positive = best;
  for (int64_t i = 0; i < vocab; ++i) {
    const double weight = std::exp((double(logits[i]) - double(logits[best])) / temperature);
    if (weight > 0.0) last_positive = i;
    cumulative += weight;
    if (target < cumulative) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last_positive);  // rounding left the draw past the total: the last possible token
}

Generation generate(const model::CausalLm& model, const GenerationRequest& request) {
  validate_generation(model, request);
  const int64_t rows = request.input_ids.size(0), width = request.input_ids.size(1), steps = request.max_new_tokens;
  const Device device = model.device();
  const int32_t* prompt = request.input_ids.data<int32_t>();

  Generation out;
  out.tokens = Tensor::empty({rows, width + steps}, DType::I32);
  out.logprobs = Tensor::empty({rows, steps}, DType::F32);
  int32_t* tokens = out.tokens.data<int32_t>();
  float* logprobs = out.logprobs.data<float>();
  for (int64_t i = 0; i < out.tokens.numel(); ++i) tokens[i] = -1;
  std::vector<Rng> rngs;
  for (int64_t b = 0; b < rows; ++b) rngs.push_back(Rng::for_key(request.seed, fmt::format("generate.row{}", b)));

  // The prefill: the prompts as the documents of one packed batch.
  std::vector<int32_t> ids, cu{0};
  std::vector<int32_t> newest;
  for (int64_t b = 0; b < rows; ++b) {
    const int32_t len = request.lengths[static_cast<size_t>(b)];
    for (int32_t t = 0; t < len; ++t) {
      ids.push_back(prompt[b * width + t]);
      tokens[b * (width + steps) + t] = prompt[b * width + t];
    }
    cu.push_back(cu.back() + len);
    newest.push_back(cu.back() - 1);
  }
  const int64_t prompt_tokens = cu.back();
  model::DecodeCache cache(rows, width + steps);
  cache.begin_prefill(request.lengths);
  model::MicroBatch prefill = model::MicroBatch::packed(
      Tensor::from_vector(ids, {prompt_tokens}),
      Tensor::from_vector(std::vector<int32_t>(static_cast<size_t>(prompt_tokens), ops::kIgnoreIndex), {prompt_tokens}),
      Tensor::from_vector(cu, {rows + 1}));
  prefill.decode = &cache;

  StageChunk chunk(model, layers_without_head(model), nullptr);
  Tensor hidden = chunk.forward(0, prefill.to(device), Tensor(), 0.0).hidden;
  chunk.drop(0);
  Tensor newest_rows = Tensor::empty({rows, hidden.size(1)}, hidden.dtype(), device);
  const Tensor newest_index = Tensor::from_vector(newest, {rows});
  ops::gather_rows(default_stream(device), newest_rows, hidden,
                   device.is_cpu() ? newest_index : newest_index.to(device));
  for (int64_t n = 0; n < steps; ++n) {
    const StepChoice step = choose(model, newest_rows, request.temperature, rngs);
    const float* lp = step.logprobs.data<float>();
    for (int64_t b = 0; b < rows; ++b) {
      const int32_t len = request.lengths[static_cast<size_t>(b)];
      tokens[b * (width + steps) + len + n] = step.tokens[static_cast<size_t>(b)];
      logprobs[b * steps + n] = lp[b];
    }
    if (n + 1 == steps) break;
    // The step: every sequence's newest token, at position (prompt length + n).
    cache.begin_step();
    std::vector<int32_t> positions;
    for (int64_t b = 0; b < rows; ++b) positions.push_back(request.lengths[static_cast<size_t>(b)] + int32_t(n));
    model::MicroBatch batch = model::MicroBatch::decode_step(Tensor::from_vector(step.tokens, {rows}),
                                                             Tensor::from_vector(positions, {rows}));
    batch.decode = &cache;
    newest_rows = chunk.forward(static_cast<int>(n + 1), batch.to(device), Tensor(), 0.0).hidden;
    chunk.drop(static_cast<int>(n + 1));
  }
  return out;
}

}  // namespace moetrain::pipeline
