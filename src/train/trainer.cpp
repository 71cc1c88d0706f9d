// defines: the training loop.
#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>

#include "core/allocator.h"
#include "core/log.h"
#include "dist/mesh.h"
#include "exact/wire_checks.h"
#include "io/safetensors.h"
#include "model/flops.h"
#include "ops/cuda/runtime.h"
#include "ops/elementwise.h"
#include "ops/optim.h"
#include "pipeline/dualpipev_executor.h"
#include "pipeline/forward_pipeline.h"
#include "pipeline/plain_executor.h"
#include "train/checkpoint.h"
#include "train/data_parallel.h"
#include "train/exact_job.h"
#include "train/fully_sharded.h"
#include "train/job_model.h"
#include "train/sharded_checkpoint.h"

namespace moetrain::train {

namespace {

// The optimizer of the job's optim section (the learning rate is the schedule's, per step).
AdamWConfig adamw_config(const io::OptimSection& optim) {
  AdamWConfig config{optim.lr, optim.beta1, optim.beta2, optim.eps, optim.weight_decay};
  config.state_dtype = optim.state_dtype == "bf16" ? DType::BF16 : DType::F32;  // validated by the job config
  // bf16 keeps 8 significant bits: a decay by beta2 of less than half an ulp (2^-9) rounds back to the same second
  // moment while the gradients are small, so it stops decaying.
  if (config.state_dtype == DType::BF16 && 1.0 - optim.beta2 < std::ldexp(1.0, -9)) {
    log_warn(
        "optim.state_dtype = bf16 with optim.beta2 = {}: a decay this slow rounds away in bf16 (1 - beta2 below "
        "2^-9), so the second moment stops decaying where gradients are small; keep f32 moments or beta2 <= 0.998",
        optim.beta2);
  }
  return config;
}

int64_t micro_batches_for(const io::TrainSection& train) {
  const int64_t rows_per_micro = train.micro_batch;
  if (train.global_batch_tokens > 0) return train.global_batch_tokens / (rows_per_micro * train.seq_len);
  return std::max<int64_t>(train.global_batch, rows_per_micro) / rows_per_micro;
}

data::LoaderOptions loader_options(const io::JobConfig& c, int64_t vocab_size) {
  data::LoaderOptions o;
  o.sources = c.data.sources;
  o.mode = c.data.mode;
  o.shuffle = c.data.shuffle;
  o.seq_len = c.train.seq_len;
  o.micro_batch = c.train.micro_batch;
  o.seed = c.train.seed;
  o.vocab_size = vocab_size;
  return o;
}

// The pipeline rank whose stages use parameter `spec`: the rank of the stage holding its decoder layer, else rank 0,
// which holds the first stage (embedding) and the last (final norm, head).
int pipeline_owner(const model::ParamSpec& spec, const pipeline::Partition& partition) {
  if (spec.layer < 0) return 0;
  for (const pipeline::StageLayers& stage : partition.stages) {
    if (spec.layer >= stage.first_layer && spec.layer < stage.end_layer) return stage.rank;
  }
  MT_FAIL("trainer: parameter '{}' belongs to decoder layer {}, which no pipeline stage holds", spec.name, spec.layer);
}

std::string weights_folder(const std::string& model_config_path) {
  const std::filesystem::path p(model_config_path);
  return std::filesystem::is_directory(p) ? p.string() : p.parent_path().string();
}

}  // namespace

Trainer::Trainer(const io::JobConfig& config, dist::Mesh* mesh)
    : config_(config), mesh_(mesh), schedule_(config.optim, config.train.steps) {
  if (mesh_ != nullptr) {
    const dist::MeshShape& shape = mesh_->shape();
    MT_CHECK(shape.world() == 1 || config.loss.load_balance != "global_batch" || config.loss.load_balance_coef == 0.0,
             "trainer: loss.load_balance = global_batch counts experts over the whole step, which data-parallel ranks "
             "do not share yet; use micro_batch or sequence with {} ranks",
             shape.world());
  }
  model_ = job_model(config);  // the same model `score` builds for the job
  const Device device = model_->device();
  const model::ModelConfig& model_config = model_->config();
  // ZeRO-3 builds its optimizer over the shards (setup_sharding): no full moments are ever allocated then.
  if (!wants_sharding()) {
    optimizer_ = std::make_unique<AdamW>(model_->params(), adamw_config(config.optim));
  }
  data::LoaderOptions loader = loader_options(config, model_config.vocab_size);
  if (mesh_ != nullptr) {
    loader.rank = mesh_->dp_ep().rank();
    loader.world = mesh_->dp_ep().size();
  }
  loader_ = std::make_unique<data::DataLoader>(loader);
  micro_batches_per_step_ = micro_batches_for(config.train);
  if (mesh_ != nullptr) {
    // The global batch is the mesh's whatever its shape: each data-parallel rank reads its share.
    const int64_t ranks = mesh_->dp_ep().size();
    MT_CHECK(micro_batches_per_step_ % ranks == 0,
             "trainer: the global batch holds {} micro-batches, which the {} data-parallel ranks cannot share "
             "evenly (make train.global_batch / train.micro_batch a multiple of {})",
             micro_batches_per_step_, ranks, ranks);
    micro_batches_per_step_ /= ranks;
  }
  const bool dualpipev = config.parallel.schedule == "dualpipev";
  MT_CHECK(!dualpipev || mesh_ != nullptr,
           "trainer: parallel.schedule = dualpipev runs over a mesh; launch thread ranks (dist.local_ranks) or "
           "processes (torchrun, srun, mpirun), or use schedule = auto for one process");
  if (mesh_ != nullptr && (mesh_->pp().size() > 1 || dualpipev)) setup_pipeline(model_config);
  if (mesh_ != nullptr && mesh_->ep().size() > 1) {
    // Stages 2 and 4 as all-to-all-v over ep (each token sent once per destination rank): each ep rank computes
    // its own experts; the expert gradients then meet in the reduction over dp x ep (the others' are zero here).
    // With pp > 1 the DualPipeV executor's stage chunks do the same.
    if (!executor_) plain_ = std::make_unique<pipeline::PlainExecutor>(*model_, &mesh_->ep());
    if (plain_) plain_->set_expert_deduplication(config.parallel.ep_dedup);
    if (executor_) executor_->set_expert_deduplication(config.parallel.ep_dedup);
    log_info("experts: {} ranks of expert parallelism, {} experts each", mesh_->ep().size(),
             model_config.num_experts / mesh_->ep().size());
  }
  if (!executor_ && !plain_) plain_ = std::make_unique<pipeline::PlainExecutor>(*model_, nullptr);
  if (plain_) plain_->set_expert_weights_per_step(config.model.expert_weight_gradient == "step");
  // DeepSeek-V2's device groups: loss.device_balance_groups, or one per expert-parallel rank (the mesh's ep, whose
  // ranks hold E / ep consecutive experts each: dist/expert_parallel.h). Unused, and so unchecked, when it is off.
  const int64_t ep_size = mesh_ != nullptr ? mesh_->ep().size() : 1;
  if (config.loss.device_balance_coef > 0.0) {
    router_loss_.device_balance_groups =
        model::resolve_device_balance_groups(config.loss.device_balance_groups, ep_size, model_config.num_experts);
  }
  if (config.loss.device_balance_coef > 0.0 && router_loss_.device_balance_groups == 1 && model_config.is_moe()) {
    log_warn(
        "loss.device_balance_coef = {} over 1 device group: the device-level balance is sum_e P_e (1 for "
        "softmax routers) and pushes no token to another group; set loss.device_balance_groups or run ep > 1",
        config.loss.device_balance_coef);
  }
  if (config.exact.enabled) setup_exact_mode(model_config);
  router_loss_.variant = model::parse_load_balance_variant(config.loss.load_balance);
  router_loss_.load_balance_coef = config.loss.load_balance_coef;
  router_loss_.z_loss_coef = config.loss.z_loss_coef;
  router_loss_.device_balance_coef = config.loss.device_balance_coef;
  router_loss_.num_moe_layers = std::max<int64_t>(model_config.num_moe_layers(), 1);
  router_loss_.running_counts = &running_counts_;
  flops_per_token_ = model::training_flops_per_token(model_config, config.train.seq_len);
  device_peak_flops_ = device.is_cuda() ? 989e12 : 0.0;  // H100/H200 dense bf16; unknown on the CPU
  log_info("model: {} with {} layers, {} parameters on {}, {} compute", model_config.model_type,
           model_config.num_hidden_layers, model_->params().num_parameters(), device.str(), config.model.compute_dtype);
  log_info("step: {} micro-batch(es) of {} tokens", micro_batches_per_step_, loader_->tokens_per_micro_batch());
  setup_eval(model_config);  // the held-out set is opened and read once here: a bad one stops the job before any step
  init_weights();
  setup_sharding();  // ZeRO-3 shards the initial values; a resume then overwrites the shards
  resume_if_possible();
  // Ranks hold the same numbers after each step's reductions: the first one reports them.
  const bool reports = first_rank();
  metrics_ = std::make_unique<MetricsLog>(reports ? config.metrics.jsonl : std::string(),
                                          reports ? config.metrics.console_every : 0,
                                          reports ? config.metrics.tensorboard : std::string());
}

// The held-out set ([eval]): its loader (the training data's mode, packed for synthetic training data; no shuffle, so
// the order is the files' own), the number of micro-batches per data rank, and the forward-only pipeline of the
// DualPipeV path. Every micro-batch of one evaluation is read once here, so that a missing or malformed file or a
// token outside the vocabulary stops the job now, naming the key, rather than at the first evaluation.
void Trainer::setup_eval(const model::ModelConfig& model_config) {
  const io::EvalSection& eval = config_.eval;
  if (eval.every <= 0) return;
  data::LoaderOptions o;
  o.sources = eval.sources;
  o.mode = config_.data.mode == "fixed" ? "fixed" : "packed";
  o.shuffle = false;
  o.seq_len = config_.train.seq_len;
  o.micro_batch = eval.micro_batch > 0 ? eval.micro_batch : config_.train.micro_batch;
  o.seed = config_.train.seed;
  o.vocab_size = model_config.vocab_size;
  const int ranks = mesh_ != nullptr ? mesh_->dp_ep().size() : 1;
  if (mesh_ != nullptr) {
    o.rank = mesh_->dp_ep().rank();
    o.world = ranks;
  }
  const int64_t micro_tokens = o.micro_batch * o.seq_len;
  // Whole micro-batches (rounded up), then a multiple of the data ranks: every rank runs the same number.
  const int64_t global = (eval.tokens + micro_tokens - 1) / micro_tokens;
  eval_micro_batches_ = (global + ranks - 1) / ranks;
  try {
    eval_loader_ = std::make_unique<data::DataLoader>(o);
    eval_start_ = eval_loader_->state();
    for (int64_t i = 0; i < eval_micro_batches_; ++i) {
      const model::MicroBatch batch = eval_loader_->next();
      if (config_.exact.enabled) exact::check_varlen_metadata(batch, config_.train.seq_len, static_cast<int>(i));
    }
    eval_loader_->restore(eval_start_);
  } catch (const Error& e) {
    MT_FAIL("eval: the held-out data (eval.path or [[eval.sources]]) cannot be read: {}", e.what());
  }
  if (executor_) {
    eval_pipeline_ = std::make_unique<pipeline::ForwardPipeline>(*model_, partition_, mesh_->pp(),
                                                                 mesh_->ep().size() > 1 ? &mesh_->ep() : nullptr);
    if (config_.exact.enabled) {  // as the training step's executor (setup_exact_mode)
      eval_pipeline_->set_wire_dtype(DType::BF16);
      eval_pipeline_->set_wire_check(
          exact_wire_check(mesh_->pp().rank(), model_config.hidden_size, config_.train.seq_len));
    }
  }
  log_info(
      "eval: every {} steps and after the last, {} micro-batch(es) of {} tokens on each of {} data rank(s) ({} "
      "tokens, eval.tokens = {})",
      eval.every, eval_micro_batches_, micro_tokens, ranks, eval_micro_batches_ * micro_tokens * ranks, eval.tokens);
}

EvalResult Trainer::evaluate() {
  MT_CHECK(eval_loader_ != nullptr, "trainer: evaluate() needs [eval] with eval.every > 0 and held-out data");
  eval_loader_->restore(eval_start_);  // the same micro-batches every time
  std::vector<model::MicroBatch> batches;
  for (int64_t i = 0; i < eval_micro_batches_; ++i) batches.push_back(eval_loader_->next());
  // No router-loss settings: the forward computes no auxiliary loss and no gradient reaches anything.
  model::StepLoss local;
  if (eval_pipeline_) {
    eval_pipeline_->run(batches, &local);  // the sums on pp rank 0, zeros on the others
  } else {
    plain_->run_forward(batches, &local);
  }
  // Token-weighted as the training step's loss: the cross-entropy sum over every target of every data rank, divided
  // by their count (pp first, where only pp rank 0 holds the loss; x + 0 = x, so the pipeline keeps its bits).
  std::vector<double> sums = {local.ce_sum, static_cast<double>(local.num_targets)};
  if (eval_pipeline_) sums = all_reduce_sum(mesh_->pp(), model_->device(), sums);
  if (mesh_ != nullptr && mesh_->dp_ep().size() > 1) sums = all_reduce_sum(mesh_->dp_ep(), model_->device(), sums);
  check_health();
  MT_CHECK(sums[1] > 0, "eval: the held-out micro-batches hold no counted target");
  return {sums[0] / sums[1], static_cast<int64_t>(sums[1])};
}

Trainer::~Trainer() = default;

// DualPipeV over the mesh's pp ranks: the partition, the executor and which parameters this rank owns.
void Trainer::setup_pipeline(const model::ModelConfig& model_config) {
  const int pp = mesh_->pp().size();
  partition_ = job_partition(config_, model_config, pp);
  MT_CHECK(micro_batches_per_step_ >= 2 * int64_t(pp),
           "trainer: DualPipeV over pp = {} ranks needs >= 2 * pp = {} micro-batches per step per pipeline, but each "
           "of the {} data-parallel pipelines gets {} (train.global_batch / train.micro_batch = {} micro-batches "
           "shared by {} data ranks); raise train.global_batch or lower parallel.pp",
           pp, 2 * pp, mesh_->dp_ep().size(), micro_batches_per_step_, micro_batches_per_step_ * mesh_->dp_ep().size(),
           mesh_->dp_ep().size());
  const int rank = mesh_->pp().rank();
  const auto& specs = model_->params().specs();
  owned_.assign(specs.size(), false);
  for (size_t i = 0; i < specs.size(); ++i) owned_[i] = pipeline_owner(specs[i], partition_) == rank;
  // With ep > 1 the stages' MoE layers dispatch and combine over the ep group (its ranks are data ranks too: their
  // gradients meet in the all-reduce over dp x ep, which spans the ranks of this pipeline stage only).
  executor_ = std::make_unique<pipeline::DualPipeVExecutor>(*model_, partition_, mesh_->pp(),
                                                            mesh_->ep().size() > 1 ? &mesh_->ep() : nullptr);
  const pipeline::StageLayers& down = partition_.down_stage(rank);
  const pipeline::StageLayers& up = partition_.up_stage(rank);
  log_info(
      "pipeline: DualPipeV over {} ranks; pp rank {} holds stage {} (layers [{}, {})) and stage {} (layers [{}, "
      "{})){}",
      pp, rank, down.stage, down.first_layer, down.end_layer, up.stage, up.first_layer, up.end_layer,
      rank == 0 ? " with the embedding, final norm and head" : "");
}

// ZeRO-3 (parallel.sharding): every rank holds the same full values now (seeded init, HF weights or a checkpoint);
// they become shards, the optimizer is rebuilt over the shards with the moments it had, and the plain executor
// gathers each part of the model around its use.
// Exact mode (docs/design.md section 6): the contract admits the job before anything runs, the model's stream runs the
// batch-invariant kernels (on CUDA, exact::cuda_batch_invariant_kernels), the residual is rounded to bf16 at every
// layer boundary, and a pipeline's activations travel as bf16 with their wire and metadata checked on every scheduled
// forward.
void Trainer::setup_exact_mode(const model::ModelConfig& model_config) {
  // The partition the job runs: the pipeline's, or pp = 1's two stages.
  admit_exact_for_job(config_, *model_, executor_ ? partition_ : job_partition(config_, model_config, 1),
                      mesh_ != nullptr ? mesh_->ep().size() : 1);
  model_->set_exact(true);
  if (executor_) {
    executor_->set_wire_dtype(DType::BF16);
    executor_->set_wire_check(exact_wire_check(mesh_->pp().rank(), model_config.hidden_size, config_.train.seq_len));
  }
}

bool Trainer::wants_sharding() const {
  const std::string& mode = config_.parallel.sharding;
  if (mesh_ == nullptr) return false;
  const bool several_data_ranks = mesh_->dp_ep().size() > 1;
  return mode == "full" ||
         (mode == "auto" && several_data_ranks && mesh_->pp().size() == 1 && config_.parallel.schedule == "auto");
}

void Trainer::setup_sharding() {
  if (!wants_sharding()) return;
  MT_CHECK(config_.model.expert_weight_gradient != "step",
           "trainer: model.expert_weight_gradient = step holds every micro-batch's expert rows until the step's end, "
           "which ZeRO-3 frees per layer; parallel.sharding = {} shards over the {} data ranks: set parallel.sharding "
           "= none, or use micro_batch",
           config_.parallel.sharding, mesh_->dp_ep().size());
  MT_CHECK(mesh_->pp().size() == 1, "trainer: parallel.sharding = full runs with pp = 1; the mesh is {}",
           mesh_->shape().str());
  MT_CHECK(plain_ != nullptr,
           "trainer: parallel.sharding = full runs on the plain executor; parallel.schedule = dualpipev is not "
           "supported with it yet");
  sharded_ = std::make_unique<FullyShardedModel>(*model_, *mesh_);
  optimizer_ =
      std::make_unique<AdamW>(sharded_->master_shards(), sharded_->grad_shards(), sharded_->compute_shards(),
                              sharded_->weight_decays(config_.optim.weight_decay), adamw_config(config_.optim));
  plain_->set_parameter_hooks(sharded_.get());
  log_info(
      "sharding: ZeRO-3 over {} data ranks (dp x ep); this rank holds {:.2f} GiB of parameter and gradient "
      "shards",
      mesh_->dp_ep().size(), static_cast<double>(sharded_->shard_bytes()) / (1 << 30));
}

std::vector<Tensor> Trainer::owned_grads() const {
  const std::vector<Tensor> all = model_->params().all_grads();
  if (owned_.empty()) return all;
  std::vector<Tensor> owned;
  for (size_t i = 0; i < all.size(); ++i) {
    if (owned_[i]) owned.push_back(all[i]);
  }
  return owned;
}

// Clips by the norm over every parameter of the model; returns that norm. Under pipeline parallelism each rank
// computes the sums of squares of the gradients it owns, the per-parameter sums are exchanged over pp (each one
// comes from exactly one rank, the others add zeros), and every rank adds them up in the store's order: the same
// bits as one rank holding the whole model.
double Trainer::clip_gradients() {
  Stream& stream = default_stream(model_->device());
  const double max_norm = config_.optim.clip_grad_norm;
  if (sharded_) return sharded_->clip_gradients(max_norm);
  if (!executor_) {
    // One rank holding every gradient: the clip's coefficient goes into the optimizer's own pass over them
    // (AdamW::step_with_clip, the same bits as scaling them first), which saves a pass over the gradients.
    const double norm = ops::global_norm(stream, model_->params().all_grads());
    pending_grad_scale_ = ops::clip_coefficient(norm, max_norm);
    return norm;
  }
  const std::vector<Tensor> grads = model_->params().all_grads();
  std::vector<double> sums(grads.size(), 0.0);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (owned_[i]) sums[i] = ops::sum_of_squares(stream, grads[i]);
  }
  sums = all_reduce_sum(mesh_->pp(), model_->device(), sums);
  double total = 0.0;
  for (double sum : sums) total += sum;
  const double norm = std::sqrt(total);
  MT_CHECK(!std::isnan(max_norm), "trainer: optim.clip_grad_norm is NaN (<= 0 disables clipping)");
  if (max_norm <= 0.0) return norm;
  // As ops::clip_by_global_norm (torch.nn.utils.clip_grad_norm_), on the owned gradients.
  const double coefficient = max_norm / (norm + 1e-6);
  if (!std::isfinite(norm) || !(coefficient < 1.0)) return norm;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (owned_[i]) ops::scale_inplace(stream, grads[i], coefficient);
  }
  return norm;
}

// AdamW; under pipeline parallelism on the owned parameters only (the others keep their values and moments).
void Trainer::optimizer_step(double lr) {
  if (executor_) {
    optimizer_->step(lr, owned_);
  } else {
    optimizer_->step_with_clip(lr, pending_grad_scale_);
  }
  pending_grad_scale_ = 1.0;
}

// Before a checkpoint under pipeline parallelism: every parameter and its moments are broadcast over pp from the
// rank that owns them, so that every rank (the saving one included) holds the whole model and optimizer state.
void Trainer::gather_pipeline_state() {
  if (!executor_) return;
  Stream& stream = default_stream(model_->device());
  const auto& specs = model_->params().specs();
  const std::vector<Tensor> params = model_->params().all_params();
  for (size_t i = 0; i < specs.size(); ++i) {
    const int owner = pipeline_owner(specs[i], partition_);
    mesh_->pp().broadcast(stream, params[i], owner);
    mesh_->pp().broadcast(stream, optimizer_->exp_avg()[i], owner);
    mesh_->pp().broadcast(stream, optimizer_->exp_avg_sq()[i], owner);
  }
  model_->params().refresh_compute_weights();
  check_health();
}

// Once per step: a collective that a watchdog aborted on any axis fails here with its error.
void Trainer::check_health() const {
  if (mesh_ == nullptr) return;
  mesh_->world().check_health();
  mesh_->pp().check_health();
  mesh_->dp().check_health();
  mesh_->ep().check_health();
  mesh_->dp_ep().check_health();
}

bool Trainer::first_rank() const { return mesh_ == nullptr || mesh_->rank() == 0; }

// ZeRO-3 gathers each layer's parameters collectively per micro-batch: every data rank must run as many. One
// all_reduce (max of the count and of its negation) tells every rank, so they all stop together.
void Trainer::check_equal_micro_batch_counts(int64_t count, int64_t step) const {
  Tensor bounds = Tensor::from_vector<int64_t>({count, -count}, {2});
  if (!model_->device().is_cpu()) bounds = bounds.to(model_->device());
  mesh_->dp_ep().all_reduce(default_stream(model_->device()), bounds, dist::ReduceOp::Max);
  const std::vector<int64_t> host = bounds.to_vector<int64_t>();
  MT_CHECK(host[0] == -host[1],
           "step {}: ZeRO-3 sharding (parallel.sharding) needs the same number of micro-batches on every data rank "
           "(its per-layer gathers are collective), but the ranks of '{}' hold between {} and {} (this rank {})",
           step + 1, mesh_->dp_ep().name(), -host[1], host[0], count);
}

int64_t Trainer::global_count(int64_t local) const {
  if (mesh_ == nullptr || mesh_->dp_ep().size() == 1) return local;
  return all_reduce_sum(mesh_->dp_ep(), model_->device(), local);
}

// Every rank's gradients and loss sums become the step's totals; each rank then holds the same
// gradients and steps the same optimizer update.
void Trainer::reduce_across_ranks(model::StepLoss& loss) const {
  if (mesh_ == nullptr || mesh_->dp_ep().size() == 1) return;
  dist::Communicator& comm = mesh_->dp_ep();
  if (!sharded_) all_reduce_gradients(comm, owned_grads());  // ZeRO-3 reduce-scattered them already
  const double tokens = static_cast<double>(loss.num_tokens);
  std::vector<double> local = {
      loss.loss, loss.ce_sum, tokens, loss.load_balance * tokens, loss.z_loss * tokens, loss.device_balance * tokens};
  // Each MoE layer's load balance, token-weighted like the step's (every rank sends one entry per MoE layer, zeros
  // when it ran no micro-batch).
  const size_t moe_layers = static_cast<size_t>(std::max<int64_t>(model_->config().num_moe_layers(), 0));
  loss.layer_load_balance.resize(moe_layers, 0.0);
  for (const double lb : loss.layer_load_balance) local.push_back(lb * tokens);
  const std::vector<double> sums = all_reduce_sum(comm, model_->device(), local);
  loss.loss = sums[0];
  loss.ce_sum = sums[1];
  loss.num_tokens = static_cast<int64_t>(sums[2]);
  loss.load_balance = sums[2] > 0 ? sums[3] / sums[2] : 0.0;
  loss.z_loss = sums[2] > 0 ? sums[4] / sums[2] : 0.0;
  loss.device_balance = sums[2] > 0 ? sums[5] / sums[2] : 0.0;
  for (size_t l = 0; l < moe_layers; ++l) loss.layer_load_balance[l] = sums[2] > 0 ? sums[6 + l] / sums[2] : 0.0;
}

void Trainer::init_weights() {
  if (config_.model.init == "pretrained") {
    const std::string folder = weights_folder(config_.model.config);
    model_->load_hf_weights(io::SafetensorsReader::open(folder));
    log_info("weights: loaded from {}", folder);
  } else {
    model_->params().init_random(config_.train.seed, config_.model.init_std);
    log_info("weights: random, seed {}, std {}", config_.train.seed, config_.model.init_std);
  }
}

// The checkpoint state every resume needs, checked before any tensor changes.
void Trainer::check_state(const nlohmann::json& state, const std::string& path) const {
  check_checkpoint_state(state, path);
  MT_CHECK(state.at("step").get<int64_t>() <= config_.train.steps,
           "checkpoint {}: it is at step {} but train.steps is {}", path, state.at("step").get<int64_t>(),
           config_.train.steps);
}

void Trainer::restore_state(const nlohmann::json& state, const std::string& path) {
  optimizer_->set_steps_taken(state.at("optimizer_steps").get<int64_t>());
  if (!state.at("data").is_null()) loader_->restore(state.at("data"));  // null: imported weights, data from the start
  step_ = state.at("step").get<int64_t>();
  log_info("resumed from {} at step {}", path, step_);
}

void Trainer::resume_if_possible() {
  if (config_.checkpoint.dir.empty() || !config_.checkpoint.resume) return;
  if (sharded_) {
    const auto latest = find_latest_checkpoint(config_.checkpoint.dir);
    if (!latest) return;
    const nlohmann::json state = resume_sharded_checkpoint(*sharded_, *optimizer_, *mesh_, *latest,
                                                           [&](const nlohmann::json& s) { check_state(s, *latest); });
    restore_state(state, *latest);
    return;
  }
  // A checkpoint that fails verification (corrupt in place) is skipped with a warning for the previous good one.
  auto loaded = load_latest_checkpoint(config_.checkpoint.dir);
  if (!loaded) return;
  const std::string* latest = &loaded->first;
  CheckpointData& data = loaded->second;
  // Validate everything before changing anything.
  check_state(data.state, *latest);
  const std::map<std::string, Tensor> stored(data.optimizer.begin(), data.optimizer.end());
  const auto& specs = model_->params().specs();
  std::map<std::string, Tensor> moments;  // in the job's moment dtype
  bool converted = false;
  for (const auto& spec : specs) {
    for (const std::string kind : {"exp_avg/", "exp_avg_sq/"}) {
      moments[kind + spec.name] =
          moment_for_job(stored, kind + spec.name, spec.shape, optimizer_->state_dtype(), *latest, &converted);
    }
  }
  model_->params().load_hf_tensors(data.model);
  for (size_t i = 0; i < specs.size(); ++i) {
    optimizer_->exp_avg()[i].copy_from(moments.at("exp_avg/" + specs[i].name));
    optimizer_->exp_avg_sq()[i].copy_from(moments.at("exp_avg_sq/" + specs[i].name));
  }
  if (converted) log_info("{}", moments_converted_line(*latest, optimizer_->state_dtype()));
  restore_state(data.state, *latest);
}

std::vector<Tensor> Trainer::full_parameters() {
  std::vector<Tensor> out;
  const auto copy_all = [&] {
    for (const Tensor& p : model_->params().all_params()) out.push_back(p.to(Device::cpu()));
  };
  if (sharded_) {
    sharded_->with_full_masters(copy_all);
  } else {
    copy_all();
  }
  return out;
}

void Trainer::save_sharded(int64_t step) {
  save_sharded_checkpoint(*sharded_, *optimizer_, *mesh_, config_, step, checkpoint_state(step));
}

nlohmann::json Trainer::checkpoint_state(int64_t step) const {
  return {{"step", step},
          {"optimizer_steps", optimizer_->steps_taken()},
          {"data", loader_->state()},
          {"seed", config_.train.seed},
          {"model_config", model::model_config_to_json(model_->config())}};
}

void Trainer::save(int64_t step) {
  CheckpointData data;
  data.step = step;
  data.model = model_->params().export_hf();
  const auto& specs = model_->params().specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    // Checkpoints hold CPU tensors: the moments live on the model's device (export_hf copies the weights itself).
    const auto on_host = [](const Tensor& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); };
    data.optimizer.emplace_back("exp_avg/" + specs[i].name, on_host(optimizer_->exp_avg()[i]));
    data.optimizer.emplace_back("exp_avg_sq/" + specs[i].name, on_host(optimizer_->exp_avg_sq()[i]));
  }
  data.state = checkpoint_state(step);
  data.config_toml = io::job_config_to_toml(config_);
  const std::string path = save_checkpoint(config_.checkpoint.dir, data, config_.checkpoint.keep);
  log_info("checkpoint: {}", path);
}

double Trainer::train_step(int64_t step) {
  std::vector<model::MicroBatch> batches;
  if (batch_source_) {
    batches = batch_source_(step);
  } else {
    for (int64_t i = 0; i < micro_batches_per_step_; ++i) batches.push_back(loader_->next());
  }
  int64_t local_targets = 0;
  for (const auto& batch : batches) local_targets += batch.num_targets();
  if (sharded_) check_equal_micro_batch_counts(static_cast<int64_t>(batches.size()), step);
  if (config_.exact.enabled) {
    for (size_t i = 0; i < batches.size(); ++i)
      exact::check_varlen_metadata(batches[i], config_.train.seq_len, static_cast<int>(i));
  }
  const int64_t targets = global_count(local_targets);
  MT_CHECK(targets > 0, "step {}: the global batch has no counted targets", step + 1);
  running_counts_.assign(static_cast<size_t>(router_loss_.num_moe_layers), {});
  router_loss_.loss_scale = 1.0 / static_cast<double>(targets);
  for (auto& batch : batches) batch.router_loss = &router_loss_;

  if (sharded_) {
    sharded_->begin_step(static_cast<int64_t>(batches.size()), config_.parallel.reduce_gradients == "micro_batch");
  } else {
    model_->params().begin_accumulation();  // the expert banks' gradients are left to their first writes
  }
  // Under pipeline parallelism every pp rank passes the step's micro-batches; only pp rank 0 reads their tokens.
  model::StepLoss loss = executor_ ? executor_->run_step(batches, targets) : plain_->run_step(batches, targets);
  if (sharded_) {
    sharded_->finish_step();  // the last gradient reductions are done before anything reads them
  } else {
    model_->params().end_accumulation();  // a gradient no micro-batch wrote (another pp rank's layer) is zero
  }
  reduce_across_ranks(loss);
  check_health();
  const double total = loss.loss + router_loss_.load_balance_coef * loss.load_balance +
                       router_loss_.z_loss_coef * loss.z_loss + router_loss_.device_balance_coef * loss.device_balance;
  MT_CHECK(std::isfinite(total),
           "step {}: the loss is {} (cross-entropy {}, load balance {}, z-loss {}, device balance {}); stopping "
           "before the optimizer step, so no checkpoint holds this state",
           step + 1, total, loss.loss, loss.load_balance, loss.z_loss, loss.device_balance);
  const double norm = clip_gradients();
  MT_CHECK(std::isfinite(norm),
           "step {}: the gradient norm is {}; stopping before the optimizer step, so no "
           "checkpoint holds this state",
           step + 1, norm);
  const double lr = schedule_.at(step);
  optimizer_step(lr);  // also writes the bf16 compute copies of the parameters it updated
  // The step's time is its device work too: wait for the optimizer's kernels (once per step).
  if (model_->device().is_cuda()) ops::cuda::synchronize(model_->device());

  last_.loss = loss.loss;
  last_.lb_loss = loss.load_balance;
  last_.z_loss = loss.z_loss;
  last_.has_device_balance = router_loss_.device_balance_coef > 0.0;
  last_.device_balance = loss.device_balance;
  last_.grad_norm = norm;
  last_.lr = lr;
  last_.tokens = loss.num_tokens;
  last_.layer_load_balance = loss.layer_load_balance;
  return loss.loss;
}

TrainSummary Trainer::run(int64_t max_steps_this_run) {
  TrainSummary summary;
  summary.first_step = step_;
  const auto start = std::chrono::steady_clock::now();
  const int64_t total = config_.train.steps;
  int64_t taken = 0;
  while (step_ < total && (max_steps_this_run <= 0 || taken < max_steps_this_run)) {
    const auto t0 = std::chrono::steady_clock::now();
    summary.losses.push_back(train_step(step_));
    summary.grad_norms.push_back(last_.grad_norm);
    ++step_;
    ++taken;
    const auto t1 = std::chrono::steady_clock::now();
    last_.step = step_;
    last_.total_steps = total;
    last_.step_seconds = std::chrono::duration<double>(t1 - t0).count();
    summary.step_seconds.push_back(last_.step_seconds);
    summary.step_tokens.push_back(last_.tokens);
    last_.elapsed_s = std::chrono::duration<double>(t1 - start).count();
    last_.tokens_per_s = static_cast<double>(last_.tokens) / last_.step_seconds;
    const double gpus = mesh_ == nullptr ? 1.0 : static_cast<double>(mesh_->shape().world());
    last_.tflops = last_.tokens_per_s / gpus * flops_per_token_ / 1e12;  // per device, as MFU needs
    last_.mfu = device_peak_flops_ > 0.0 ? last_.tflops * 1e12 / device_peak_flops_ : 0.0;
    last_.peak_mem_bytes = memory_stats(model_->device().kind).peak_bytes;
    last_.host_rss_bytes = host_resident_bytes();
    last_.eta_s = last_.elapsed_s / static_cast<double>(taken) * static_cast<double>(total - step_);
    summary.layer_load_balance.insert(summary.layer_load_balance.end(), last_.layer_load_balance.begin(),
                                      last_.layer_load_balance.end());
    last_.has_eval = config_.eval.every > 0 && (step_ % config_.eval.every == 0 || step_ == total);
    if (last_.has_eval) {  // after the step's timing: tokens/s and MFU stay the training step's
      const EvalResult eval = evaluate();
      last_.eval_loss = eval.loss;
      last_.eval_tokens = eval.tokens;
      last_.eval_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
      summary.eval_steps.push_back(step_);
      summary.eval_losses.push_back(eval.loss);
    }
    metrics_->record(last_);
    const bool periodic = config_.checkpoint.every > 0 && step_ % config_.checkpoint.every == 0;
    if (!config_.checkpoint.dir.empty() && (periodic || step_ == total)) {
      gather_pipeline_state();  // collective over pp: every rank takes part
      if (sharded_) {
        save_sharded(step_);  // collective: every rank writes its own shard file
      } else if (first_rank()) {
        save(step_);
      }
    }
  }
  summary.last_step = step_;
  return summary;
}

}  // namespace moetrain::train
