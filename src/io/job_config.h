// defines: JobConfig, the typed form of a job's TOML file (--config job.toml), with every field
// overridable on the command line as --section.key=value in the manner of torchtitan. Unknown
// sections or keys and values of the wrong type are errors that name the key. The resolved
// configuration is printed at start and saved beside the checkpoints. Users script against these
// keys: keep them stable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moetrain::io {

struct ModelSection {
  std::string config;           // HF model folder or config.json path (required)
  std::string init = "random";  // "random" (from train.seed) or "pretrained" (weights from the folder)
  double init_std = 0.02;       // std of the normal init of matrices ("random"); norms start at 1
  std::string device = "cpu";   // cpu | cuda | cuda:N
  // f32: everything in fp32. bf16 (CUDA): bf16 weights copies and activations, fp32 accumulation,
  // fp32 masters, gradients and optimizer state.
  std::string compute_dtype = "f32";
  // The residual stream (the hidden state between layers and its gradient): "compute" keeps it in the compute dtype
  // (bf16 under bf16 compute, as Megatron-Core and torchtitan do by default); "f32" keeps it in f32 under bf16 compute
  // as autocast does (Megatron-Core's fp32_residual_connection), at 2 more bytes per element of the stream.
  std::string residual_dtype = "compute";
  // "activation": every gated MLP recomputes its activation (SwiGLU) in the backward instead of keeping it from the
  // forward (the same bits; less memory, one more activation kernel per layer). "none": keep it.
  std::string recompute = "none";
  // When an expert bank's weight gradients are computed: "micro_batch", after each micro-batch's backward, adding
  // into the f32 gradient; or "step", once a step over every micro-batch's rows (one grouped GEMM per weight: each
  // expert's gradient written once instead of read and written per micro-batch), holding the experts' inputs and
  // output gradients of every micro-batch until then. "step" runs with pp = 1, without parallel.sharding = full and
  // not in exact mode (its f32 sums run in another order than the per-micro-batch ones).
  std::string expert_weight_gradient = "micro_batch";
  // The LM head and the cross-entropy fused over vocabulary chunks of this many columns (the [T, V]
  // logits never exist); 0: the logits are materialised (in the compute dtype) and the loss read from them.
  int64_t head_chunk = 8192;
};

struct DataSource {
  std::string path;     // indexed dataset prefix (path.idx + path.bin)
  double weight = 1.0;  // mixture weight (normalised over the sources)
};

struct DataSection {
  std::vector<DataSource> sources;  // TOML: [[data.sources]] path = ..., weight = ...
  // Shorthand for one source: data.path = "prefix" (a single source of weight 1); an empty override
  // (--data.path=) removes every source.
  std::string mode = "packed";  // "packed": whole or split documents, attention within each;
                                // "fixed": rows of seq_len tokens cut from the token stream;
                                // "synthetic": uniformly random token rows, no files (benchmarks)
  bool shuffle = true;          // shuffle documents per epoch from train.seed
};

struct TrainSection {
  int64_t steps = 0;                // required, > 0
  int64_t seq_len = 0;              // tokens per row (required, > 0)
  int64_t micro_batch = 1;          // rows per micro-batch: a micro-batch holds micro_batch * seq_len tokens
  int64_t global_batch = 0;         // rows per optimizer step over all ranks (multiple of micro_batch)
  int64_t global_batch_tokens = 0;  // alternative to global_batch: tokens per step (multiple of micro-batch tokens)
  uint64_t seed = 1234;
};

struct OptimSection {
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;        // matrices only; norms, biases and 1-D tensors get none
  std::string schedule = "cosine";  // constant | cosine | linear | wsd (each after warmup)
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.1;        // floor of cosine / linear / wsd decay, as a fraction of lr
  double decay_fraction = 0.2;      // wsd: fraction of the steps spent in the final decay
  double clip_grad_norm = 1.0;      // <= 0 disables clipping
  std::string state_dtype = "f32";  // f32 | bf16: the AdamW moments' dtype (bf16 halves their memory and bytes)
};

struct LossSection {
  std::string load_balance = "micro_batch";  // micro_batch | global_batch | sequence
  double load_balance_coef = 0.0;            // 0 disables the load-balance loss
  double z_loss_coef = 0.0;                  // router z-loss; 0 disables it
  // DeepSeek-V2's device-level balance loss over the micro-batch (model/router_loss.h); 0 disables it.
  double device_balance_coef = 0.0;
  // Its number of expert groups D: 0 = the run's expert-parallel degree; else D >= 1 dividing the experts.
  int64_t device_balance_groups = 0;
};

struct CheckpointSection {
  std::string dir;     // empty: no checkpoints
  int64_t every = 0;   // 0: only at the end
  int64_t keep = 3;    // newest checkpoints kept (>= 1)
  bool resume = true;  // resume from the newest complete checkpoint in dir
};

// The mesh axes of docs/design.md section 1 (dp is what remains of the world: world / (pp * cp * ep)).
struct ParallelSection {
  int64_t pp = 1;                // pipeline ranks P (DualPipeV: 2P stages in a V)
  int64_t ep = 1;                // expert-parallel ranks
  int64_t cp = 1;                // context-parallel ranks
  std::vector<int64_t> pp_cuts;  // explicit stage cuts (2P - 1 increasing layer indices); empty: balanced by cost
  // Data-parallel sharding: "full" (ZeRO-3: parameters, gradients and optimizer state sharded over dp x ep), "none"
  // (replicated, gradients all-reduced), or "auto" (full when pp = 1 and there are several data ranks).
  std::string sharding = "auto";
  // ZeRO-3's gradient reduce-scatter: after every micro-batch's backward ("micro_batch", the least memory), or once
  // per step after the last one ("step": the full gradients accumulate over the step, a fraction of the traffic).
  std::string reduce_gradients = "micro_batch";
  // The training step's executor: "auto" (DualPipeV when pp > 1, the plain one otherwise) or "dualpipev" (DualPipeV
  // at any pp; with pp = 1 both chunks of the V sit on each rank and a forward still overlaps a backward, which hides
  // the expert-parallel all-to-alls of one micro-batch behind the other's compute).
  std::string schedule = "auto";
  // Expert-parallel dispatch: each token sent once to each ep rank holding any of its experts (true), or one row per
  // (token, expert) (false: no index building on the host, one host read per layer instead of two).
  bool ep_dedup = true;
};

struct DistSection {
  // N > 0: N thread ranks in this one process (on the CPU, or sharing one GPU); 0: the launcher's processes.
  int64_t local_ranks = 0;
  int64_t timeout_s = 300;  // collectives and rendezvous give up (fail closed) after this many seconds
};

// Exact lanes (docs/design.md section 6, docs/exact_lanes.md): byte-identical forward outputs whatever
// the pipeline cut, the packing and the padding, behind a fail-closed admission contract.
struct ExactSection {
  bool enabled = false;
};

struct MetricsSection {
  std::string jsonl;          // empty: no JSONL file
  int64_t console_every = 1;  // a progress line every N steps
  std::string tensorboard;    // a folder for TensorBoard event files (created; rank 0 writes); empty: none
};

// Validation loss during training (docs/training.md, "Evaluation"): every `every` steps and after the last one, the
// token-weighted cross-entropy of the first `tokens` tokens of the held-out set, in a fixed unshuffled order (the same
// every evaluation and after a resume), forward only through the training executors.
struct EvalSection {
  std::vector<DataSource> sources;  // TOML: eval.path = PREFIX or [[eval.sources]] path = ..., weight = ...
  int64_t every = 0;                // steps between evaluations; 0: no evaluation
  // Tokens per evaluation, rounded up to whole micro-batches of micro_batch x train.seq_len, then to a multiple of
  // the data-parallel ranks (each runs the same number); at least one micro-batch.
  int64_t tokens = 0;
  int64_t micro_batch = 0;  // rows per evaluation micro-batch; 0: train.micro_batch
};

struct JobConfig {
  ModelSection model;
  DataSection data;
  TrainSection train;
  OptimSection optim;
  LossSection loss;
  CheckpointSection checkpoint;
  MetricsSection metrics;
  ParallelSection parallel;
  DistSection dist;
  ExactSection exact;
  EvalSection eval;
};

// Reads `toml_path` (may be empty: defaults only), applies `overrides` in order (each
// "section.key=value", the leading "--" already stripped or not), validates the result and
// returns it. Errors name the file, the key and expected vs found.
JobConfig load_job_config(const std::string& toml_path, const std::vector<std::string>& overrides);
// Same from TOML text (`source` names it in errors).
JobConfig parse_job_config(const std::string& toml_text, const std::string& source,
                           const std::vector<std::string>& overrides);
// The resolved configuration as TOML; parse_job_config of it gives the same JobConfig.
std::string job_config_to_toml(const JobConfig& config);

}  // namespace moetrain::io
