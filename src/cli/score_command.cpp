// defines: the score command: input validation, the per-micro-batch forward, the job's model and
// its exact admission, and the atomic write of the log-probs.
#include "cli/score_command.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include "cli/train_command.h"
#include "core/error.h"
#include "core/log.h"
#include "exact/wire_checks.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "ops/cuda/runtime.h"
#include "ops/loss.h"
#include "pipeline/partition.h"
#include "train/checkpoint.h"

namespace moetrain::cli {

namespace {

namespace fs = std::filesystem;

constexpr const char* kInputIds = "input_ids";
constexpr const char* kCuSeqlens = "cu_seqlens";
constexpr const char* kLogprobs = "logprobs";

// The folder of HF weights beside model.config (a folder, or the folder of a config.json).
std::string weights_folder(const std::string& model_config_path) {
  const fs::path p(model_config_path);
  return fs::is_directory(p) ? p.string() : p.parent_path().string();
}

// [0, T, 2T, ..., BT]: one document per row.
Tensor rows_cu_seqlens(int64_t rows, int64_t row_tokens) {
  std::vector<int32_t> cu(static_cast<size_t>(rows + 1));
  for (int64_t r = 0; r <= rows; ++r) cu[static_cast<size_t>(r)] = static_cast<int32_t>(r * row_tokens);
  return Tensor::from_vector(cu, {rows + 1});
}

}  // namespace

void validate_score_input(const ScoreInput& input, int64_t vocab_size, const std::string& what) {
  const char* w = what.c_str();
  const Tensor& ids = input.input_ids;
  MT_CHECK(ids.defined(), "{}: no tensor '{}' (expected int32 [B, T] token ids)", w, kInputIds);
  MT_CHECK(ids.dtype() == DType::I32, "{}: '{}' must be int32 [B, T] but is {}", w, kInputIds, ids.describe());
  MT_CHECK(ids.dim() == 2, "{}: '{}' must be 2-D [B, T] (rows of tokens) but is {}", w, kInputIds, ids.describe());
  MT_CHECK(ids.device().is_cpu() && ids.is_contiguous(), "{}: '{}' must be a contiguous CPU tensor but is {}", w,
           kInputIds, ids.describe());
  const int64_t rows = ids.size(0), row_tokens = ids.size(1);
  MT_CHECK(rows >= 1, "{}: '{}' must have at least one row but is {}", w, kInputIds, ids.describe());
  MT_CHECK(row_tokens >= 2, "{}: '{}' must have T >= 2 tokens per row (row t + 1 is scored given its prefix) but is {}",
           w, kInputIds, ids.describe());
  int64_t num_tokens = 0;
  MT_CHECK(!__builtin_mul_overflow(rows, row_tokens, &num_tokens) && num_tokens <= INT32_MAX,
           "{}: '{}' {} holds more than 2^31 - 1 tokens (int32 cu_seqlens cannot address them)", w, kInputIds,
           ids.describe());
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < num_tokens; ++i) {
    MT_CHECK(id[i] >= 0 && id[i] < vocab_size, "{}: '{}'[{}, {}] = {} is outside the vocabulary [0, {})", w, kInputIds,
             i / row_tokens, i % row_tokens, id[i], vocab_size);
  }

  const Tensor& cu = input.cu_seqlens;
  MT_CHECK(cu.defined(), "{}: no '{}' (expected int32 [D + 1]; leave it out of the file for one document per row)", w,
           kCuSeqlens);
  MT_CHECK(cu.dtype() == DType::I32, "{}: '{}' must be int32 but is {}", w, kCuSeqlens, cu.describe());
  MT_CHECK(cu.dim() == 1, "{}: '{}' must be 1-D [D + 1] but is {}", w, kCuSeqlens, cu.describe());
  MT_CHECK(cu.device().is_cpu() && cu.is_contiguous(), "{}: '{}' must be a contiguous CPU tensor but is {}", w,
           kCuSeqlens, cu.describe());
  const int64_t n = cu.numel();
  MT_CHECK(n >= 2, "{}: '{}' must have >= 2 entries (at least one document) but has {}", w, kCuSeqlens, n);
  const int32_t* c = cu.data<int32_t>();
  MT_CHECK(c[0] == 0, "{}: '{}' must start at 0 but cu_seqlens[0] is {}", w, kCuSeqlens, c[0]);
  for (int64_t i = 1; i < n; ++i) {
    MT_CHECK(c[i] > c[i - 1],
             "{}: '{}' must be strictly increasing but cu_seqlens[{}] = {} is not greater than cu_seqlens[{}] = {}", w,
             kCuSeqlens, i, c[i], i - 1, c[i - 1]);
  }
  MT_CHECK(c[n - 1] == num_tokens, "{}: '{}' must end at B * T = {} * {} = {} (the token count) but ends at {}", w,
           kCuSeqlens, rows, row_tokens, num_tokens, c[n - 1]);
  // Every row boundary r * T is a document boundary: a document never crosses rows.
  int64_t i = 0;
  for (int64_t r = 1; r < rows; ++r) {
    const int64_t boundary = r * row_tokens;
    while (i < n && c[i] < boundary) ++i;
    MT_CHECK(i < n && c[i] == boundary,
             "{}: '{}' lacks the row boundary {} (row {} starts at token {} * T = {}); a document never crosses "
             "rows: end every row's last document at the row's end",
             w, kCuSeqlens, boundary, r, r, boundary);
  }
}

ScoreInput read_score_input(const std::string& path, int64_t vocab_size) {
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  const std::string what = fmt::format("score input {}", path);
  for (const std::string& name : file.names()) {
    MT_CHECK(name == kInputIds || name == kCuSeqlens,
             "{}: unexpected tensor '{}' (the input holds '{}' int32 [B, T] and optionally '{}' int32 [D + 1])", what,
             name, kInputIds, kCuSeqlens);
  }
  ScoreInput input;
  MT_CHECK(file.contains(kInputIds), "{}: no tensor '{}' (expected int32 [B, T] token ids)", what, kInputIds);
  input.input_ids = file.tensor(kInputIds).clone();
  if (file.contains(kCuSeqlens)) {
    input.cu_seqlens = file.tensor(kCuSeqlens).clone();
  } else if (input.input_ids.dim() == 2) {
    input.cu_seqlens = rows_cu_seqlens(input.input_ids.size(0), input.input_ids.size(1));
  }
  validate_score_input(input, vocab_size, what);
  return input;
}

model::MicroBatch score_micro_batch(const ScoreInput& input, int64_t row_begin, int64_t row_end) {
  const int64_t rows = input.rows(), T = input.row_tokens();
  MT_CHECK(0 <= row_begin && row_begin < row_end && row_end <= rows,
           "score: micro-batch rows [{}, {}) are not a non-empty range inside the input's {} rows", row_begin, row_end,
           rows);
  const int64_t begin = row_begin * T, end = row_end * T, tokens = end - begin;
  const int32_t* c = input.cu_seqlens.data<int32_t>();
  const int64_t n = input.cu_seqlens.numel();
  std::vector<int32_t> cu;
  for (int64_t i = 0; i < n; ++i) {
    if (c[i] >= begin && c[i] <= end) cu.push_back(static_cast<int32_t>(c[i] - begin));
  }
  const Tensor ids = input.input_ids.view({-1}).slice(begin, end).clone();
  const int32_t* id = ids.data<int32_t>();
  std::vector<int32_t> targets(static_cast<size_t>(tokens), ops::kIgnoreIndex);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int32_t t = cu[d]; t + 1 < cu[d + 1]; ++t) targets[static_cast<size_t>(t)] = id[t + 1];
  }
  const int64_t docs = static_cast<int64_t>(cu.size());
  return model::MicroBatch::packed(ids, Tensor::from_vector(targets, {tokens}), Tensor::from_vector(cu, {docs}));
}

Tensor score_logprobs(const model::CausalLm& model, const ScoreInput& input, int64_t rows_per_micro_batch,
                      bool check_exact_metadata) {
  MT_CHECK(rows_per_micro_batch >= 1, "score: rows per micro-batch must be >= 1 but is {}", rows_per_micro_batch);
  const int64_t rows = input.rows(), T = input.row_tokens();
  Tensor out = Tensor::empty({rows, T - 1}, DType::F32);
  float* o = out.data<float>();
  int micro_batch = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += rows_per_micro_batch, ++micro_batch) {
    const int64_t r1 = std::min(rows, r0 + rows_per_micro_batch);
    const model::MicroBatch batch = score_micro_batch(input, r0, r1);
    if (check_exact_metadata) exact::check_varlen_metadata(batch, T, micro_batch);
    model::ForwardObservation observe;
    model::forward_only(model, {batch}, &observe);
    MT_CHECK(observe.token_logprobs.size() == 1, "score: expected the log-probs of one micro-batch, found {}",
             observe.token_logprobs.size());
    const float* lp = observe.token_logprobs[0].data<float>();
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(o + r * (T - 1), lp + (r - r0) * T, static_cast<size_t>(T - 1) * sizeof(float));
    }
  }
  return out;
}

std::unique_ptr<model::CausalLm> make_model_for_job(const io::JobConfig& config) {
  const Device device = parse_device(config.model.device);
  if (device.is_cuda()) ops::cuda::setup_cuda(device.index);
  const io::ModelConfig model_config = io::load_model_config(config.model.config);
  const DType compute_dtype = config.model.compute_dtype == "bf16" ? DType::BF16 : DType::F32;
  return std::make_unique<model::CausalLm>(model_config, device, compute_dtype);
}

void load_job_weights(const io::JobConfig& config, model::CausalLm& model) {
  const std::optional<std::string> latest =
      config.checkpoint.dir.empty() ? std::nullopt : train::find_latest_checkpoint(config.checkpoint.dir);
  if (latest) {
    const train::CheckpointData data = train::load_checkpoint(*latest);
    model.params().load_hf_tensors(data.model);
    log_info("weights: checkpoint {} (step {})", *latest, data.step);
  } else if (config.model.init == "pretrained") {
    const std::string folder = weights_folder(config.model.config);
    model.params().load_hf(io::SafetensorsReader::open(folder));
    log_info("weights: loaded from {}", folder);
  } else {
    model.params().init_random(config.train.seed, config.model.init_std);
    log_info("weights: random, seed {}, std {}", config.train.seed, config.model.init_std);
  }
}

std::unique_ptr<model::CausalLm> load_model_for_job(const io::JobConfig& config) {
  std::unique_ptr<model::CausalLm> model = make_model_for_job(config);
  load_job_weights(config, *model);
  return model;
}

exact::AdmissionReport admit_exact_for_job(const io::JobConfig& config, const model::CausalLm& model) {
  exact::ExactDeclaration declaration;
  // The CPU's exact program: f32 math within a layer, the residual rounded to bf16 at every layer
  // boundary, fp32 masters: "bf16 compute with uniformly fp32 masters" in the contract's terms.
  declaration.compute_dtype = "bf16";
  declaration.wire_dtype = DType::BF16;
  declaration.device = model.device();
  declaration.loss = "cross_entropy";
  declaration.load_balance = config.loss.load_balance;
  declaration.load_balance_coef = config.loss.load_balance_coef;
  declaration.z_loss_coef = config.loss.z_loss_coef;
  for (const model::ParamSpec& spec : model.params().specs())
    declaration.parameter_dtypes.push_back({spec.name, model.params().param(spec.name).dtype()});
  const int pp = static_cast<int>(config.parallel.pp);
  const pipeline::Partition partition =
      config.parallel.pp_cuts.empty() ? pipeline::partition_balanced(model.config(), pp)
                                      : pipeline::partition_from_cuts(model.config(), pp, config.parallel.pp_cuts);
  return exact::admit_exact(declaration, model.config(), partition);
}

int run_score(const ScoreOptions& options) {
  // 1. Everything is validated before any weight is read or any byte written.
  const io::JobConfig config = io::load_job_config(options.config_path, options.overrides);
  const io::ParallelSection& p = config.parallel;
  MT_CHECK(
      p.pp == 1 && p.ep == 1 && p.cp == 1,
      "score: parallel.pp = {}, parallel.ep = {}, parallel.cp = {}: scoring through the pipeline / expert-parallel "
      "executor is not wired yet; run score with parallel.pp = 1, parallel.ep = 1 and parallel.cp = 1 (in exact "
      "mode the bytes do not depend on the cut)",
      p.pp, p.ep, p.cp);
  MT_CHECK(!options.input.empty() && !options.out.empty(), "score: --input and --out are both required");
  std::error_code ec;
  const fs::path out_path = fs::absolute(options.out, ec);
  MT_CHECK(!ec, "score: --out {}: not a usable path ({})", options.out, ec.message());
  const fs::path out_dir = out_path.parent_path();
  MT_CHECK(fs::is_directory(out_dir, ec), "score: --out {}: its folder {} does not exist", options.out,
           out_dir.string());
  MT_CHECK(!fs::is_directory(out_path, ec), "score: --out {} is a folder; expected a file path", options.out);
  MT_CHECK(!fs::exists(options.input, ec) || !fs::equivalent(options.input, out_path, ec),
           "score: --out {} is the input file; write the log-probs elsewhere", options.out);

  std::unique_ptr<model::CausalLm> model = make_model_for_job(config);
  const ScoreInput input = read_score_input(options.input, model->config().vocab_size);
  if (config.exact.enabled) admit_exact_for_job(config, *model);  // throws listing every violation

  // 2. Weights, then the forward.
  load_job_weights(config, *model);
  model->set_exact(config.exact.enabled);
  log_info("score: {} rows of {} tokens, {} documents, micro-batches of {} rows{}", input.rows(), input.row_tokens(),
           input.cu_seqlens.numel() - 1, config.train.micro_batch, config.exact.enabled ? ", exact" : "");
  const Tensor logprobs = score_logprobs(*model, input, config.train.micro_batch, config.exact.enabled);
  io::write_safetensors(out_path.string(), {{kLogprobs, logprobs}},
                        {{"format", "moetrain-score"}, {"exact", config.exact.enabled ? "true" : "false"}});
  log_info("score: wrote {} (logprobs f32 [{}, {}])", out_path.string(), input.rows(), input.row_tokens() - 1);
  return 0;
}

void add_score_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* score = app.add_subcommand(
      "score",
      "Per-token log-probs of token rows under the job's model (newest checkpoint in checkpoint.dir, else "
      "model.init).\n"
      "Input (safetensors): input_ids int32 [B, T]; optional cu_seqlens int32 [D + 1], document boundaries over the\n"
      "B*T flattened tokens: starts at 0, ends at B*T, strictly increasing, holds every row boundary r*T (absent: one\n"
      "document per row). Output (safetensors): logprobs f32 [B, T-1], entry [b, t] = log p(token t+1 | its prefix\n"
      "in its document), 0 where token t ends a document. --exact.enabled=true runs the exact lanes\n"
      "(docs/exact_lanes.md). Extra --section.key=value arguments override the job file.");
  auto options = std::make_shared<ScoreOptions>();  // kept alive by the callbacks below
  score->add_option("--config", options->config_path, "job TOML file")->required();
  score->add_option("--input", options->input, "safetensors file with input_ids [and cu_seqlens]")->required();
  score->add_option("--out", options->out, "safetensors file to write (logprobs), atomically")->required();
  score->allow_extras();
  score->callback([score, options, &command] {
    command = [score, options] {
      ScoreOptions resolved = *options;
      resolved.overrides = collect_overrides(score->remaining());
      return run_score(resolved);
    };
  });
}

}  // namespace moetrain::cli
