// defines: `moetrain score --config job.toml --input FILE --out FILE [--section.key=value ...]`: the
// per-token log-probabilities of token rows under the job's model (forward only), the evaluation
// path users run on checkpoints and the one the exact lanes' byte gates compare (docs/exact_lanes.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/tensor.h"
#include "exact/admission.h"
#include "io/job_config.h"
#include "model/batch.h"
#include "model/causal_lm.h"

namespace moetrain::cli {

// The input file, a safetensors file with exactly these tensors:
//   input_ids   int32 [B, T], B >= 1 rows of T >= 2 tokens, every id inside the vocabulary;
//   cu_seqlens  (optional) int32 [D + 1], the document boundaries over the B * T flattened tokens
//               (global offsets): starts at 0, ends at B * T, strictly increasing, and holds every
//               row boundary r * T (a document never crosses rows). Absent: one document per row.
struct ScoreInput {
  Tensor input_ids;   // i32 [B, T] (CPU)
  Tensor cu_seqlens;  // i32 [D + 1] (CPU); filled with [0, T, 2T, ..., BT] when the file has none
  int64_t rows() const { return input_ids.size(0); }
  int64_t row_tokens() const { return input_ids.size(1); }
};

// Checks every rule above (input_ids and cu_seqlens present or absent as above, dtypes, shapes,
// the cu_seqlens rules, ids in [0, vocab_size)). `what` names the input in errors, each of which
// says what was expected and what was found.
void validate_score_input(const ScoreInput& input, int64_t vocab_size, const std::string& what);

// Reads `path` (no other tensors allowed), fills the default cu_seqlens and validates it.
ScoreInput read_score_input(const std::string& path, int64_t vocab_size);

// The micro-batch of rows [row_begin, row_end): their tokens flattened, the documents inside them
// (cu_seqlens rebased to the first row), targets = the next token of the same document and -100
// at the last token of every document.
model::MicroBatch score_micro_batch(const ScoreInput& input, int64_t row_begin, int64_t row_end);

// logprobs f32 [B, T - 1] on the CPU: entry [b, t] = log p(input_ids[b, t + 1] | its prefix in its
// document), +0.0 where token t ends a document. Rows run through `model` in micro-batches of
// `rows_per_micro_batch` rows, forward only. With `check_exact_metadata` every micro-batch's varlen
// metadata passes exact::check_varlen_metadata (declared max length: T) before it runs.
Tensor score_logprobs(const model::CausalLm& model, const ScoreInput& input, int64_t rows_per_micro_batch,
                      bool check_exact_metadata = false);

// The model a job describes (model.config) on model.device in model.compute_dtype, parameters zero.
std::unique_ptr<model::CausalLm> make_model_for_job(const io::JobConfig& config);
// Its weights: those of the newest complete checkpoint in checkpoint.dir when there is one (whatever
// checkpoint.resume says), else model.init (pretrained: the HF folder's weights; random: from
// train.seed and model.init_std).
void load_job_weights(const io::JobConfig& config, model::CausalLm& model);
// Both. Exact mode is not set here.
std::unique_ptr<model::CausalLm> load_model_for_job(const io::JobConfig& config);

// The exact-lane admission of a job (DESIGN.md section 6) for `model`: on the CPU the exact
// program is declared as bf16 compute with uniformly fp32 masters, a bf16 wire, the parameter
// dtypes of the store, the job's losses and device, and the partition of parallel.pp (balanced by
// cost, or parallel.pp_cuts). Throws listing every violation; logs one line per stage on success.
exact::AdmissionReport admit_exact_for_job(const io::JobConfig& config, const model::CausalLm& model);

struct ScoreOptions {
  std::string config_path;             // job TOML
  std::string input;                   // safetensors with input_ids [and cu_seqlens]
  std::string out;                     // safetensors written with logprobs f32 [B, T - 1]
  std::vector<std::string> overrides;  // "section.key=value"
};

// Validates everything (job, parallel layout, input, output folder, exact admission) before it
// scores; writes `out` atomically, so a failure leaves no output file. Returns the exit code (0).
int run_score(const ScoreOptions& options);

void add_score_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
