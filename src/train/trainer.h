// defines: Trainer, the training loop of a job (one rank; data parallelism, replicated or ZeRO-3 sharded; expert
// parallelism; DualPipeV pipeline parallelism; exact mode): model and optimizer set-up (from a seed or HF weights),
// automatic resume from the newest complete checkpoint, micro-batch accumulation with the token-weighted loss,
// clipping, AdamW on fp32 masters, the LR schedule, NaN/Inf detection (stop before the optimizer step; never checkpoint
// poisoned state), metrics (JSONL, console, TensorBoard), the held-out evaluation ([eval]) and checkpoints.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/job_config.h"
#include "model/causal_lm.h"
#include "pipeline/partition.h"
#include "train/data/loader.h"
#include "train/lr_schedule.h"
#include "train/metrics.h"
#include "train/optimizer.h"

namespace moetrain::dist {
class Mesh;
}
namespace moetrain::pipeline {
class DualPipeVExecutor;
class ForwardPipeline;
class PlainExecutor;
}  // namespace moetrain::pipeline

namespace moetrain::train {

class FullyShardedModel;

struct TrainSummary {
  int64_t first_step = 0;            // steps already done when this run started (resume point)
  int64_t last_step = 0;             // steps done when it stopped
  std::vector<double> losses;        // loss of every step this run took
  std::vector<double> grad_norms;    // gradient norm before clipping, per step
  std::vector<double> step_seconds;  // wall time of every step, device work included
  std::vector<int64_t> step_tokens;  // tokens of every step
  // The load balance of each MoE layer at every step, step-major: steps x MoE layers values (empty for a dense
  // model). One flat vector: a small vector kept per step would stay allocated between the step's tensors and
  // fragment the heap, growing the resident memory of a long run.
  std::vector<double> layer_load_balance;
  std::vector<int64_t> eval_steps;  // the steps after which an evaluation ran ([eval])
  std::vector<double> eval_losses;  // their held-out losses
};

// One evaluation ([eval]): the token-weighted cross-entropy over `tokens` held-out targets of every data rank.
struct EvalResult {
  double loss = 0.0;
  int64_t tokens = 0;
};

// Supplies the micro-batches of a step instead of the data loader (tests feed reference batches).
using BatchSource = std::function<std::vector<model::MicroBatch>(int64_t step)>;

class Trainer {
 public:
  // `mesh`: this rank's device mesh when the job has several ranks, else null. Data parallelism
  // runs over its dp x ep ranks; with mesh.pp() > 1 each step runs DualPipeV over the pp ranks
  // (the layers cut by parallel.pp_cuts, or balanced by cost), and this rank computes gradients
  // for, clips with and updates only the parameters of its two stages (owns_parameter); with ep > 1
  // too, the stages' MoE layers dispatch and combine over the ep ranks. With pp = 1 and several data
  // ranks the parameters, gradients and optimizer state are ZeRO-3 shards (parallel.sharding; see
  // fully_sharded.h). exact.enabled passes the admission contract first. Refused: with pp > 1 fewer
  // than 2 * pp micro-batches per step per pipeline or fewer than 2 * pp decoder layers.
  explicit Trainer(const io::JobConfig& config, dist::Mesh* mesh = nullptr);
  ~Trainer();

  // Runs until train.steps, or until `max_steps_this_run` steps were taken (> 0; for tests that
  // stop a run midway). Checkpoints every checkpoint.every steps and at train.steps.
  TrainSummary run(int64_t max_steps_this_run = 0);

  void use_batch_source(BatchSource source) { batch_source_ = std::move(source); }

  // Evaluates the held-out set of [eval] now (collective: every rank of the mesh calls it): the first eval.tokens
  // tokens (rounded up to whole micro-batches, then to a multiple of the data ranks) in a fixed unshuffled order,
  // forward only through the training executor (the plain one, with ep; DualPipeV's forward pipeline when pp > 1),
  // no gradient, no router-loss gradient, no optimizer, training data or RNG state touched. run() calls it every
  // eval.every steps and after the last. Refused when eval.every = 0.
  EvalResult evaluate();
  // Micro-batches of one evaluation on each data rank (0 when [eval] is off).
  int64_t eval_micro_batches() const { return eval_micro_batches_; }

  const model::CausalLm& model() const { return *model_; }
  const AdamW& optimizer() const { return *optimizer_; }
  double flops_per_token() const { return flops_per_token_; }
  int64_t steps_done() const { return step_; }
  int64_t micro_batches_per_step() const { return micro_batches_per_step_; }
  // Whether this rank owns parameter `index` (store order): computes its gradient and updates it.
  // Every parameter without pipeline parallelism; with it, those of this rank's two stages (rank 0
  // also holds the embedding, the final norm and the head). The others keep their initial values,
  // except after a checkpoint, which gathers the whole model on every pp rank.
  // The full fp32 masters on the CPU, in the store's order. Collective under ZeRO-3 (every rank of the mesh calls
  // it); under pipeline parallelism the parameters this rank does not own hold their initial values.
  std::vector<Tensor> full_parameters();
  // ZeRO-3 (parallel.sharding) is on: the store's full parameters exist only inside full_parameters() and saves.
  bool sharded() const { return sharded_ != nullptr; }
  const FullyShardedModel* sharded_model() const { return sharded_.get(); }
  bool owns_parameter(size_t index) const { return owned_.empty() || owned_.at(index); }
  // The layer partition of the pipeline (pp > 1 only; pp = 1 otherwise with no stages).
  const pipeline::Partition& partition() const { return partition_; }

 private:
  bool first_rank() const;
  int64_t global_count(int64_t local) const;
  void check_equal_micro_batch_counts(int64_t count, int64_t step) const;
  void reduce_across_ranks(model::StepLoss& loss) const;
  void init_weights();
  void resume_if_possible();
  void save(int64_t step);
  void save_sharded(int64_t step);
  nlohmann::json checkpoint_state(int64_t step) const;
  void check_state(const nlohmann::json& state, const std::string& path) const;
  void restore_state(const nlohmann::json& state, const std::string& path);
  bool wants_sharding() const;
  void setup_exact_mode(const model::ModelConfig& model_config);
  void setup_sharding();
  double train_step(int64_t step);
  void setup_pipeline(const model::ModelConfig& model_config);
  std::vector<Tensor> owned_grads() const;
  double clip_gradients();
  void optimizer_step(double lr);
  void gather_pipeline_state();
  void check_health() const;
  void setup_eval(const model::ModelConfig& model_config);

  io::JobConfig config_;
  dist::Mesh* mesh_ = nullptr;
  std::unique_ptr<model::CausalLm> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<data::DataLoader> loader_;
  LrSchedule schedule_;
  std::unique_ptr<MetricsLog> metrics_;  // created last in the constructor: a refused job writes no file
  model::RouterLossSettings router_loss_;
  std::vector<Tensor> running_counts_;  // global_batch: i32 [E] per MoE layer (model/router_loss.h)
  int64_t micro_batches_per_step_ = 0;
  int64_t step_ = 0;
  double flops_per_token_ = 0.0;
  double device_peak_flops_ = 0.0;
  StepMetrics last_;
  BatchSource batch_source_;
  // Pipeline parallelism (mesh.pp() > 1).
  pipeline::Partition partition_;
  std::unique_ptr<pipeline::DualPipeVExecutor> executor_;
  std::unique_ptr<pipeline::PlainExecutor> plain_;  // pp = 1 without the DualPipeV schedule (ep, ZeRO-3 or one rank)
  std::unique_ptr<FullyShardedModel> sharded_;      // ZeRO-3 (parallel.sharding); the plain executor runs its hooks
  std::vector<bool> owned_;                         // per parameter; empty: this rank owns every parameter
  // The clip's coefficient for the coming optimizer step (single rank: AdamW applies it; 1 otherwise).
  double pending_grad_scale_ = 1.0;
  // Evaluation ([eval]): the held-out loader, rewound to its start before every evaluation, and the forward-only
  // pipeline of the DualPipeV path.
  std::unique_ptr<data::DataLoader> eval_loader_;
  nlohmann::json eval_start_;
  int64_t eval_micro_batches_ = 0;
  std::unique_ptr<pipeline::ForwardPipeline> eval_pipeline_;
};

}  // namespace moetrain::train
