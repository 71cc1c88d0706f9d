// defines: DualPipeVExecutor, which runs one pipeline rank's DualPipeV op list (dualpipev_schedule) for a training
// step: point-to-point transfers at the schedule's commit points, its two stage chunks, the zero-bubble weight
// queue, and the overlapped forward & backward pairs interleaved stage by stage.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/tensor.h"
#include "dist/communicator.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "pipeline/dualpipev_schedule.h"
#include "pipeline/partition.h"
#include "pipeline/stage_chunk.h"

namespace moetrain::pipeline {

// Wire protocol, per message of the schedule (both rounds are posted as one group at each commit point):
//   round 1: a header, i32 [kHeaderInts] = {kWireMagic, kind, chunk, micro-batch, T, H, D}, so that the receiver
//            can size the payload and check that it got the message the schedule names;
//   round 2: the payload, compute dtype [T, H] (the activation or the gradient), and for activations the
//            micro-batch's metadata, i32 [D + 1 + T] = cu_seqlens then position_ids.
inline constexpr int kHeaderInts = 7;
inline constexpr int32_t kWireMagic = 0x4450'5631;  // "DPV1"

class DualPipeVExecutor {
 public:
  // `model` holds (at least) the parameters of this rank's two stages and must outlive the executor; gradients
  // accumulate into the model's gradients of those stages only. `pp_comm` is the pipeline axis: its size is
  // partition.pp and its rank is this rank's position in the V.
  DualPipeVExecutor(const model::CausalLm& model, const Partition& partition, dist::Communicator& pp_comm);

  // One step over `batches` (n >= 2P micro-batches; every rank passes n entries). Only rank 0, which holds the
  // first and the last stage, reads the micro-batches' tokens and targets; the other ranks receive each
  // micro-batch's T, cu_seqlens and position_ids with its activation and read nothing from their list but the
  // step's router-loss settings (MicroBatch::router_loss). The loss scale is 1 / global_num_targets, or 1 / the
  // targets counted over `batches` when global_num_targets <= 0 (as model::forward_backward). Gradients
  // accumulate (the caller zeroes them). Every rank returns the same StepLoss (summed over pp in rank order, so
  // it is the same bits as the single-rank forward_backward's).
  model::StepLoss run_step(const std::vector<model::MicroBatch>& batches, int64_t global_num_targets);

  int rank() const { return rank_; }
  const StageChunk& chunk(int c) const { return *chunks_.at(static_cast<size_t>(c)); }
  // Records held by both chunks (0 after a completed step).
  int64_t live_records() const;
  // When set, every compute step of the next steps is appended ("op: <describe(op)>" lines, then the step labels
  // in the order they ran), for tests and debugging.
  void set_trace(std::vector<std::string>* trace) { trace_ = trace; }

 private:
  using MessageKey = std::tuple<TransferKind, int, int>;  // kind, chunk, micro-batch
  struct Message {
    Tensor payload;           // [T, H]
    model::MicroBatch batch;  // activations: the metadata that travels with them
  };

  void commit(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs);
  void compute(const PipelineOp& op);
  void run_steps(const std::vector<ChunkStep>& steps);
  // Inputs of a chunk's forward and backward, from the inbox (or the batch list on rank 0).
  model::MicroBatch forward_batch(int chunk, int microbatch, Tensor& input);
  Tensor output_grad(int chunk, int microbatch);
  void after_forward(int chunk, int microbatch, const model::MicroBatch& batch, ChunkForward result);
  void after_backward(int chunk, int microbatch, Tensor d_input);
  Message take(const MessageKey& key, const char* what);

  const model::CausalLm& model_;
  Partition partition_;
  dist::Communicator& comm_;
  int rank_ = 0;
  int num_ranks_ = 1;
  std::vector<std::unique_ptr<StageChunk>> chunks_;  // chunk 0 (down), chunk 1 (up)
  std::vector<std::string>* trace_ = nullptr;

  // Per step.
  const std::vector<model::MicroBatch>* batches_ = nullptr;
  double loss_scale_ = 0.0;
  std::map<MessageKey, Message> inbox_;   // received, or handed over locally on rank P - 1
  std::map<MessageKey, Message> outbox_;  // computed, waiting for the commit point that sends it
  std::deque<ChunkWork> weight_queue_;    // deferred backward_weight, FIFO
  std::vector<model::LossSum> losses_;    // loss stage, per micro-batch
  std::vector<double> router_table_;      // [n, layers, 2]: load_balance * tokens, z_loss * tokens
};

}  // namespace moetrain::pipeline
