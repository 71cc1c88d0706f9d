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
#include "dist/mesh.h"
#include "exact/wire_checks.h"
#include "io/safetensors.h"
#include "model/model_config.h"
#include "ops/cuda/runtime.h"
#include "ops/loss.h"
#include "pipeline/forward_pipeline.h"
#include "pipeline/partition.h"
#include "pipeline/plain_executor.h"
#include "train/checkpoint.h"
#include "train/data/loader.h"
#include "train/exact_job.h"
#include "train/job_model.h"
#include "train/launch.h"

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
  // A document never crosses rows (the rule the training loader packs by): cutting at the rows adds nothing.
  const std::vector<int32_t> given = cu.to_vector<int32_t>();
  const std::vector<int32_t> cut = train::data::cut_documents_at_rows(given, row_tokens);
  const auto missing = std::mismatch(cut.begin(), cut.end(), given.begin(), given.end()).first;
  if (missing != cut.end()) {
    const int64_t boundary = *missing, r = boundary / row_tokens;
    MT_FAIL(
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
    const std::vector<Tensor> logprobs = pipeline::PlainExecutor(model, nullptr).run_forward({batch});
    MT_CHECK(logprobs.size() == 1, "score: expected the log-probs of one micro-batch, found {}", logprobs.size());
    const float* lp = logprobs[0].data<float>();
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(o + r * (T - 1), lp + (r - r0) * T, static_cast<size_t>(T - 1) * sizeof(float));
    }
  }
  return out;
}

std::unique_ptr<model::CausalLm> make_model_for_job(const io::JobConfig& config) { return train::job_model(config); }

void load_job_weights(const io::JobConfig& config, model::CausalLm& model) {
  const std::optional<std::string> latest =
      config.checkpoint.dir.empty() ? std::nullopt : train::find_latest_checkpoint(config.checkpoint.dir);
  if (latest) {
    const train::CheckpointData data = train::load_checkpoint(*latest);
    model.params().load_hf_tensors(data.model);
    log_info("weights: checkpoint {} (step {})", *latest, data.step);
  } else if (config.model.init == "pretrained") {
    const std::string folder = weights_folder(config.model.config);
    model.load_hf_weights(io::SafetensorsReader::open(folder));
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

ScoreShare score_share(int64_t num_micro_batches, int data_ranks, int data_rank, bool equal_counts) {
  MT_CHECK(num_micro_batches >= 1 && data_ranks >= 1 && 0 <= data_rank && data_rank < data_ranks,
           "score: expected >= 1 micro-batches and a data rank in [0, {}) of >= 1 data ranks; found {} micro-batches "
           "and data rank {}",
           data_ranks, num_micro_batches, data_rank);
  ScoreShare share;
  for (int64_t m = data_rank; m < num_micro_batches; m += data_ranks) share.micro_batches.push_back(m);
  share.real = static_cast<int64_t>(share.micro_batches.size());
  if (equal_counts) {
    const int64_t most = (num_micro_batches + data_ranks - 1) / data_ranks;
    while (static_cast<int64_t>(share.micro_batches.size()) < most)
      share.micro_batches.push_back(data_rank % num_micro_batches);
  }
  return share;
}

namespace {

// Where micro-batch `m` of a job sits in the log-prob buffers the ranks gather: on data rank m mod D, in slot
// m / D (a slot holds `rows_per_micro_batch` rows of T - 1 floats).
struct SlotLayout {
  int64_t rows = 0, row_tokens = 0, rows_per_micro_batch = 0, micro_batches = 0, slots = 0;
  int data_ranks = 1;
  int64_t slot_floats() const { return rows_per_micro_batch * (row_tokens - 1); }
  int64_t rank_floats() const { return slots * slot_floats(); }
};

// The index of the micro-batch a wire check is called with, for its messages. Ranks other than pp rank 0 get a copy
// built from the wire's metadata, so it is found by content (token count and cu_seqlens), in order from `cursor`:
// the pipeline runs the micro-batches one after another. -1 when none matches (the checks still run).
// A micro-batch's token count from its metadata: a batch received over the wire carries cu_seqlens and position_ids
// but no tokens.
int64_t metadata_tokens(const model::MicroBatch& batch) {
  return batch.position_ids.defined() ? batch.position_ids.numel() : batch.num_tokens();
}

int wire_micro_batch(const std::vector<model::MicroBatch>& batches, const std::vector<int64_t>& indices,
                     const model::MicroBatch& batch, size_t& cursor) {
  const auto same = [&](const model::MicroBatch& b) {
    if (&b == &batch) return true;
    if (b.num_tokens() != metadata_tokens(batch) || !batch.cu_seqlens_host.defined() ||
        b.cu_seqlens_host.numel() != batch.cu_seqlens_host.numel())
      return false;
    return b.cu_seqlens_host.to_vector<int32_t>() == batch.cu_seqlens_host.to_vector<int32_t>();
  };
  for (size_t j = cursor; j < batches.size(); ++j) {
    if (same(batches[j])) {
      cursor = j;
      return static_cast<int>(indices[j]);
    }
  }
  return -1;
}

}  // namespace

Tensor score_logprobs_on_mesh(const io::JobConfig& config, const model::CausalLm& model, const ScoreInput& input,
                              dist::Mesh* mesh) {
  const bool exact = config.exact.enabled;
  const dist::MeshShape shape = mesh != nullptr ? mesh->shape() : dist::MeshShape{};
  const dist::MeshCoord coord = mesh != nullptr ? mesh->coord() : dist::MeshCoord{};
  MT_CHECK(shape.cp == 1, "score: parallel.cp = {}: context parallelism is not supported by score", shape.cp);
  SlotLayout layout;
  layout.rows = input.rows();
  layout.row_tokens = input.row_tokens();
  layout.rows_per_micro_batch = config.train.micro_batch;
  MT_CHECK(layout.rows_per_micro_batch >= 1, "score: train.micro_batch (rows per micro-batch) must be >= 1 but is {}",
           layout.rows_per_micro_batch);
  layout.micro_batches = (layout.rows + layout.rows_per_micro_batch - 1) / layout.rows_per_micro_batch;
  layout.data_ranks = shape.dp * shape.ep;
  layout.slots = (layout.micro_batches + layout.data_ranks - 1) / layout.data_ranks;
  const int data_rank = coord.dp * shape.ep + coord.ep;
  // With ep > 1 the expert exchange is collective: every data rank runs the same count (padding repeats).
  const ScoreShare share = score_share(layout.micro_batches, layout.data_ranks, data_rank, shape.ep > 1);
  const int64_t T = layout.row_tokens, per = layout.rows_per_micro_batch;

  std::vector<model::MicroBatch> batches;
  for (const int64_t m : share.micro_batches) {
    batches.push_back(score_micro_batch(input, m * per, std::min(layout.rows, (m + 1) * per)));
    if (exact) exact::check_varlen_metadata(batches.back(), T, static_cast<int>(m));
  }

  std::vector<Tensor> logprobs;
  dist::Communicator* ep = shape.ep > 1 ? &mesh->ep() : nullptr;
  if (shape.pp == 1) {
    logprobs = pipeline::PlainExecutor(model, ep).run_forward(batches);
  } else {
    const pipeline::Partition partition =
        train::job_partition(config, model.config(), static_cast<int>(config.parallel.pp));
    pipeline::ForwardPipeline forward(model, partition, mesh->pp(), ep);
    size_t cursor = 0;  // the wire check's place in `batches`
    if (exact) {
      forward.set_wire_dtype(DType::BF16);
      const int stage = coord.pp;
      const int64_t hidden = model.config().hidden_size;
      forward.set_wire_check([&, stage, hidden](const Tensor& activation, const model::MicroBatch& batch) {
        const int m = wire_micro_batch(batches, share.micro_batches, batch, cursor);
        const int64_t tokens = metadata_tokens(batch);
        exact::check_wire_tensor(activation, stage, m, tokens, hidden);
        // The host copy is what a received batch holds (it serves q and k alike).
        exact::check_varlen_metadata(batch.cu_seqlens_host, batch.cu_seqlens_host, tokens, T, m);
      });
    }
    // A data rank without micro-batches (more data ranks than micro-batches, ep = 1): its whole pp group skips.
    if (!batches.empty()) logprobs = forward.run(batches);
  }

  // This rank's log-probs into its slots (pp rank 0 holds them; the padding repeats are dropped here).
  Tensor mine = Tensor::zeros({layout.rank_floats()}, DType::F32);
  if (coord.pp == 0) {
    MT_CHECK(logprobs.size() == batches.size(),
             "score: expected the log-probs of {} micro-batches on pp rank 0, found {}", batches.size(),
             logprobs.size());
    float* out = mine.data<float>();
    for (int64_t j = 0; j < share.real; ++j) {
      const int64_t m = share.micro_batches[static_cast<size_t>(j)];
      const int64_t rows = std::min(layout.rows, (m + 1) * per) - m * per;
      const Tensor& lp = logprobs[static_cast<size_t>(j)];
      MT_CHECK(lp.dtype() == DType::F32 && lp.device().is_cpu() && lp.numel() == rows * T,
               "score: micro-batch {}: expected f32 [{}] log-probs on the CPU, found {}", m, rows * T, lp.describe());
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(out + j * layout.slot_floats() + r * (T - 1), lp.data<float>() + r * T,
                    static_cast<size_t>(T - 1) * sizeof(float));
      }
    }
  }

  // Every rank's slots to every rank (all_gather works on both backends), then world rank 0 reads its rows.
  Tensor all = mine;
  const int world = mesh != nullptr ? mesh->world().size() : 1;
  if (world > 1) {
    const Device device = model.device();
    Stream& stream = default_stream(device);
    const Tensor sent = device.is_cpu() ? mine : mine.to(device);
    Tensor gathered = Tensor::empty({world * layout.rank_floats()}, DType::F32, device);
    mesh->world().all_gather(stream, gathered, sent);
    all = device.is_cpu() ? gathered : gathered.to(Device::cpu());
  }
  if (mesh != nullptr && mesh->rank() != 0) return Tensor();
  Tensor result = Tensor::empty({layout.rows, T - 1}, DType::F32);
  float* o = result.data<float>();
  const float* a = all.data<float>();
  for (int64_t m = 0; m < layout.micro_batches; ++m) {
    const int d = static_cast<int>(m % layout.data_ranks);
    const int64_t slot = m / layout.data_ranks;
    const int source = dist::mesh_rank(shape, dist::MeshCoord{0, d / shape.ep, 0, d % shape.ep});
    const int64_t rows = std::min(layout.rows, (m + 1) * per) - m * per;
    std::memcpy(o + m * per * (T - 1), a + source * layout.rank_floats() + slot * layout.slot_floats(),
                static_cast<size_t>(rows * (T - 1)) * sizeof(float));
  }
  return result;
}

namespace {

// What every rank validates before any weight is read or byte written.
struct ScorePlan {
  ScoreInput input;
  fs::path out_path;
  std::unique_ptr<model::CausalLm> model;  // parameters zero until load_job_weights
};

// Paths, the input against the model's vocabulary, the exact admission and every micro-batch's varlen metadata.
ScorePlan prepare_score(const io::JobConfig& config, const ScoreOptions& options) {
  MT_CHECK(!options.input.empty() && !options.out.empty(), "score: --input and --out are both required");
  std::error_code ec;
  ScorePlan plan;
  plan.out_path = fs::absolute(options.out, ec);
  MT_CHECK(!ec, "score: --out {}: not a usable path ({})", options.out, ec.message());
  const fs::path out_dir = plan.out_path.parent_path();
  MT_CHECK(fs::is_directory(out_dir, ec), "score: --out {}: its folder {} does not exist", options.out,
           out_dir.string());
  MT_CHECK(!fs::is_directory(plan.out_path, ec), "score: --out {} is a folder; expected a file path", options.out);
  MT_CHECK(!fs::exists(options.input, ec) || !fs::equivalent(options.input, plan.out_path, ec),
           "score: --out {} is the input file; write the log-probs elsewhere", options.out);
  MT_CHECK(config.train.micro_batch >= 1, "score: train.micro_batch (rows per micro-batch) must be >= 1 but is {}",
           config.train.micro_batch);

  plan.model = make_model_for_job(config);
  plan.input = read_score_input(options.input, plan.model->config().vocab_size);
  if (config.parallel.pp > 1)
    train::job_partition(config, plan.model->config(),
                         static_cast<int>(config.parallel.pp));  // refuses a cut the model cannot take
  if (config.exact.enabled) {
    train::admit_exact_for_job(config, *plan.model,
                               train::job_partition(config, plan.model->config(), static_cast<int>(config.parallel.pp)),
                               config.parallel.ep);  // throws listing every violation
    const int64_t per = config.train.micro_batch, rows = plan.input.rows();
    for (int64_t m = 0; m * per < rows; ++m) {
      exact::check_varlen_metadata(score_micro_batch(plan.input, m * per, std::min(rows, (m + 1) * per)),
                                   plan.input.row_tokens(), static_cast<int>(m));
    }
  }
  return plan;
}

// Every rank learns whether every rank validated: a refusal on one rank stops all of them (none waits on it).
void agree_to_score(dist::Communicator& world, Device device, const std::string& local_error) {
  const int n = world.size();
  Tensor mine = Tensor::from_vector<int32_t>({local_error.empty() ? 0 : 1}, {1});
  if (!device.is_cpu()) mine = mine.to(device);
  Tensor all = Tensor::empty({static_cast<int64_t>(n)}, DType::I32, device);
  world.all_gather(default_stream(device), all, mine);
  const std::vector<int32_t> failed = all.to_vector<int32_t>();
  if (!local_error.empty()) MT_FAIL("{}", local_error);
  for (int p = 0; p < n; ++p) {
    MT_CHECK(failed[static_cast<size_t>(p)] == 0,
             "score: rank {} of the world refused the job (its own error says why); rank {} stops too", p,
             world.rank());
  }
}

// Weights, the forward on this rank's share, the gather; world rank 0 writes the file.
void score_rank(const io::JobConfig& config, const ScoreInput& input, const fs::path& out_path, model::CausalLm& model,
                dist::Mesh* mesh) {
  load_job_weights(config, model);
  model.set_exact(config.exact.enabled);
  const Tensor logprobs = score_logprobs_on_mesh(config, model, input, mesh);
  if (mesh != nullptr && mesh->rank() != 0) return;
  io::write_safetensors(out_path.string(), {{kLogprobs, logprobs}},
                        {{"format", "moetrain-score"}, {"exact", config.exact.enabled ? "true" : "false"}});
  log_info("score: wrote {} (logprobs f32 [{}, {}])", out_path.string(), input.rows(), input.row_tokens() - 1);
}

void log_score_start(const io::JobConfig& config, const ScoreInput& input, const dist::MeshShape& shape) {
  log_info("score: {} rows of {} tokens, {} documents, micro-batches of {} rows, mesh {}{}", input.rows(),
           input.row_tokens(), input.cu_seqlens.numel() - 1, config.train.micro_batch, shape.str(),
           config.exact.enabled ? ", exact" : "");
}

}  // namespace

int run_score(const ScoreOptions& options) {
  // 1. Everything is validated before any weight is read or any byte written.
  io::JobConfig config = io::load_job_config(options.config_path, options.overrides);
  const io::ParallelSection& p = config.parallel;
  MT_CHECK(p.cp == 1, "score: parallel.cp = {}: context parallelism is not supported by score; set parallel.cp = 1",
           p.cp);

  if (config.dist.local_ranks > 1) {
    // Thread ranks share this process: validated once here, before any rank starts.
    const int world = static_cast<int>(config.dist.local_ranks);
    const dist::MeshShape shape = train::job_mesh_shape(config, world);  // refuses a world the mesh does not divide
    ScorePlan plan = prepare_score(config, options);
    plan.model.reset();  // every rank builds its own
    log_score_start(config, plan.input, shape);
    train::run_on_thread_ranks(config, [&](dist::Mesh& mesh) {
      std::unique_ptr<model::CausalLm> model = make_model_for_job(config);
      score_rank(config, plan.input, plan.out_path, *model, &mesh);
    });
    return 0;
  }

  // A process alone, or this process's rank of a launcher's world (NCCL): every process validates, then all agree.
  dist::Mesh* mesh = train::setup_process_mesh(config);  // refuses a world the mesh does not divide
  ScorePlan plan;
  std::string error;
  try {
    plan = prepare_score(config, options);
  } catch (const Error& e) {
    if (mesh == nullptr) throw;
    error = e.what();
  }
  if (mesh != nullptr) agree_to_score(mesh->world(), parse_device(config.model.device), error);
  if (mesh == nullptr || mesh->rank() == 0)
    log_score_start(config, plan.input, mesh != nullptr ? mesh->shape() : dist::MeshShape{});

  // 2. Weights, the forward, the gather, the write.
  score_rank(config, plan.input, plan.out_path, *plan.model, mesh);
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
