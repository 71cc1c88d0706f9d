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
#include "pipeline/partition.h"

namespace moetrain::dist {
class Mesh;
}

namespace moetrain::cli {

// The input file, a safetensors file with exactly these tensors:
//   input_ids   int32 [B, T], B >= 1 rows of T >= 2 tokens, every id inside the vocabulary;
//   cu_seqlens  (optional) int32 [D + 1], the document boundaries over the B * T flattened tokens
//               (global offsets): starts at 0, ends at B * T, strictly increasing, and holds every
//               row boundary r * T (a document never crosses rows: train::data::cut_documents_at_rows,
//               the rule the training loader packs by, adds nothing). Absent: one document per row.
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

// How score spreads its M micro-batches (micro-batch m = rows [m * train.micro_batch, (m + 1) * train.micro_batch))
// over the D = dp x ep data ranks (data rank dp_i * ep + ep_i, the dp_ep order of dist/mesh.h): round robin, data
// rank d runs micro-batches d, d + D, d + 2D, ... in that order (every pp rank of its pipeline runs the same list).
// With `equal_counts` (ep > 1: the expert exchange is collective) every data rank runs ceil(M / D) micro-batches: a
// rank with fewer appends repeats of the real micro-batch d mod M, whose output is dropped.
struct ScoreShare {
  std::vector<int64_t> micro_batches;  // micro-batch indices, in the order the rank runs them
  int64_t real = 0;                    // the first `real` are this rank's; the rest are padding repeats
};
ScoreShare score_share(int64_t num_micro_batches, int data_ranks, int data_rank, bool equal_counts);

// The log-probs of `input` (as score_logprobs) computed by the ranks of `mesh` (null: this process alone), each with
// its copy of the job's model with weights loaded and exact mode set: micro-batches spread by score_share, pp = 1
// through pipeline::PlainExecutor::run_forward (with the ep exchange), pp > 1 through pipeline::ForwardPipeline (in
// exact mode a bf16 wire, and exact::check_wire_tensor / check_varlen_metadata on every activation a stage sends
// or receives); in exact mode every micro-batch's varlen metadata is checked before it runs. Collective over the
// mesh's world: the rows are gathered (all_gather) and world rank 0 gets f32 [B, T - 1] on the CPU; every other
// rank an undefined tensor.
Tensor score_logprobs_on_mesh(const io::JobConfig& config, const model::CausalLm& model, const ScoreInput& input,
                              dist::Mesh* mesh);

struct ScoreOptions {
  std::string config_path;             // job TOML
  std::string input;                   // safetensors with input_ids [and cu_seqlens]
  std::string out;                     // safetensors written with logprobs f32 [B, T - 1]
  std::vector<std::string> overrides;  // "section.key=value"
};

// Runs on the job's ranks: dist.local_ranks > 1 thread ranks on the CPU or one GPU (each with its Mesh), or this
// process's rank of a launcher's world (train::setup_process_mesh, NCCL), or this process alone; the mesh is
// parallel.pp x dp x ep with dp = world / (pp x ep); parallel.cp > 1 is refused. Validates everything (job, mesh,
// input, output folder, exact admission, every micro-batch's varlen metadata) on every rank before any weight is read
// or byte written (launcher ranks then agree, so one rank's refusal stops all). World rank 0 writes `out` atomically,
// so a failure leaves no output file; the other ranks write nothing. Returns the exit code (0).
int run_score(const ScoreOptions& options);

void add_score_command(CLI::App& app, std::function<int()>& command);

}  // namespace moetrain::cli
