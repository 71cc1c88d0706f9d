// defines: ForwardPipeline, a forward-only pass of micro-batches through the 2P stages of a DualPipeV partition
// (scoring, exact-mode log-probs): each micro-batch in turn down and up the V, with DualPipeVExecutor's wire
// protocol between ranks and expert parallelism inside the stages when an ep communicator is given.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "pipeline/dualpipev_executor.h"  // WireCheck, the wire protocol and its helpers
#include "pipeline/partition.h"
#include "pipeline/stage_chunk.h"

namespace moetrain::pipeline {

// WireCheck (pipeline/dualpipev_executor.h): called on every activation a stage receives or sends in a forward (set
// by exact mode to its wire checks), with the tensor in the wire dtype; not for the local hand-over between the two
// chunks of one rank (the bottom of the V, and everything when pp = 1).
class ForwardPipeline {
 public:
  // `model` holds (at least) the parameters of this rank's two stages and must outlive the pipeline, as must `pp`
  // and `ep`. `pp` is the pipeline axis (its size is partition.pp, its rank this rank's position in the V). `ep`
  // (may be null): this rank's expert-parallel group; its ranks are data ranks, each ep peer's pp rank 0 reading its
  // own micro-batches, and the MoE layers exchange rows over it (collective: every ep peer must pass the same n).
  ForwardPipeline(const model::CausalLm& model, const Partition& partition, dist::Communicator& pp,
                  dist::Communicator* ep = nullptr);
  ~ForwardPipeline();
  ForwardPipeline(const ForwardPipeline&) = delete;
  ForwardPipeline& operator=(const ForwardPipeline&) = delete;

  // Wire dtype of the activations sent between ranks (default: the model's residual stream dtype). BF16 with an f32
  // model: cast on send (refused with a clear error if a value is not on the bf16 grid, i.e. not exact mode), cast
  // back on receipt.
  void set_wire_dtype(DType dtype);
  void set_wire_check(WireCheck check);

  // Forward only of every micro-batch (n >= 1, the same n on every pp and ep rank) through the 2P stages in the
  // V; no records kept past a micro-batch. Only pp rank 0 (first and last stage) reads the micro-batches (tokens,
  // targets; validated there); the other ranks receive each one's metadata with its activation and read only the
  // router-loss settings from their list. Before any transfer, every pp and ep rank learns whether every rank can
  // go on (n agrees, rank 0's micro-batches are valid), so a refusal is an error on every rank, not a hang.
  // Returns on pp rank 0 one f32 [T] CPU tensor per micro-batch, the token log-probs (as
  // ForwardObservation::token_logprobs); an empty vector on the other ranks. `loss` (may be null) receives on pp
  // rank 0 the cross-entropy sum, counted targets and tokens of the micro-batches, summed in order as
  // PlainExecutor::run_forward sums them (loss = ce_sum / num_targets; no router losses); zeros on the other ranks.
  std::vector<Tensor> run(const std::vector<model::MicroBatch>& batches, model::StepLoss* loss = nullptr);

 private:
  void agree(int64_t count, const std::string& local_error);
  // Sends stage `stage`'s output of micro-batch `mb` to `peer` / receives the input of stage `stage` from `peer`.
  void send_activation(int stage, int mb, const Tensor& hidden, const model::MicroBatch& batch, int peer);
  Tensor recv_activation(int stage, int mb, int peer, const model::MicroBatch& local, model::MicroBatch& batch);

  const model::CausalLm& model_;
  Partition partition_;
  dist::Communicator& pp_;
  dist::Communicator* ep_;
  int rank_ = 0;
  int num_ranks_ = 1;
  std::vector<std::unique_ptr<StageChunk>> chunks_;  // chunk 0 (down), chunk 1 (up)
  DType wire_dtype_;
  WireCheck wire_check_;
};

}  // namespace moetrain::pipeline
