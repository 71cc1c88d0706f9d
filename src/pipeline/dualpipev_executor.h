// defines: DualPipeVExecutor, which runs one pipeline rank's DualPipeV op list (dualpipev_schedule) for a training
// step: point-to-point transfers at the schedule's commit points, its two stage chunks, the zero-bubble weight
// queue, and the overlapped forward & backward pairs interleaved stage by stage. With an ep communicator the chunks
// run expert parallelism's dispatch and combine (StageChunk). Also the wire protocol and its helpers, which
// ForwardPipeline shares.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
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
//   round 2: the payload, stream dtype [T, H] (the activation or the gradient), and for activations the
//            micro-batch's metadata, i32 [D + 1 + T] = cu_seqlens then position_ids.
// Activations travel in the wire dtype (set_wire_dtype; default the model's residual stream dtype), gradients in the
// stream dtype.
inline constexpr int kHeaderInts = 7;
inline constexpr int32_t kWireMagic = 0x4450'5631;  // "DPV1"

// Called on every activation a stage receives or sends in a forward (set by exact mode to its wire checks): on the
// sending rank before the send and on the receiving rank on receipt, with the tensor as it travels (in the wire
// dtype) and the micro-batch's metadata (cu_seqlens and position_ids; tokens and targets only where the rank holds
// them). Not called for the local hand-over at the bottom of the V, which crosses no wire.
using WireCheck = std::function<void(const Tensor& activation, const model::MicroBatch& batch)>;

// The wire helpers of the protocol (DualPipeVExecutor and ForwardPipeline).
// Refuses a wire dtype other than the model's residual stream dtype or bf16 with an f32 stream; `who` names the caller.
void check_wire_dtype(const model::CausalLm& model, DType wire, const char* who);
// The activation as it travels: itself when it is in the wire dtype already, else cast to bf16, refused with a
// clear error when a value is not on the bf16 grid (a bf16 wire with an f32 model needs exact mode). `what` names
// the activation in the error.
Tensor activation_to_wire(const Tensor& activation, DType wire, const std::string& what);
// Back to the stream dtype on receipt (exact: every bf16 value is an f32 value).
Tensor activation_from_wire(const Tensor& wire, DType stream);
// The metadata that travels with an activation: i32 [D + 1 + T] = cu_seqlens then position_ids, on `device`.
Tensor encode_metadata(const model::MicroBatch& batch, Device device);
// A micro-batch holding the received metadata (cu_seqlens, its host copy, position_ids; no tokens or targets) on
// `device`, after checking the cu_seqlens rules and that positions restart at every document. `what` names the
// message in errors.
model::MicroBatch decode_metadata(const Tensor& meta, int64_t num_tokens, int64_t num_documents, Device device,
                                  const std::string& what);

class DualPipeVExecutor {
 public:
  // `model` holds (at least) the parameters of this rank's two stages and must outlive the executor; gradients
  // accumulate into the model's gradients of those stages only. `pp_comm` is the pipeline axis: its size is
  // partition.pp and its rank is this rank's position in the V. `ep` (may be null): this rank's expert-parallel
  // group, handed to both chunks. Its ranks are also data ranks: each ep peer's pp rank 0 reads its own
  // micro-batches, every ep peer must run the same number of micro-batches (the same op list), and the caller sums
  // gradients over dp x ep (a rank's gradients of experts it does not own stay 0, and its non-expert gradients
  // cover its own micro-batches only).
  DualPipeVExecutor(const model::CausalLm& model, const Partition& partition, dist::Communicator& pp_comm,
                    dist::Communicator* ep = nullptr);

  // Dtype of the activations sent between ranks (default: the model's stream dtype). BF16 with an f32 stream: cast
  // on send (refused with a clear error if a value is not on the bf16 grid, i.e. not exact mode), cast back on
  // receipt. Gradients always travel in the stream dtype.
  void set_wire_dtype(DType dtype);
  DType wire_dtype() const { return wire_dtype_; }
  void set_wire_check(WireCheck check) { wire_check_ = std::move(check); }

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
  // Both chunks' expert dispatch: each token once per destination rank (default) or every (token, expert) row.
  void set_expert_deduplication(bool on) {
    for (auto& chunk : chunks_) chunk->set_expert_deduplication(on);
  }
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
  DType wire_dtype_;
  WireCheck wire_check_;

  // Per step.
  const std::vector<model::MicroBatch>* batches_ = nullptr;
  std::vector<model::MicroBatch> on_device_;  // rank 0: the step's micro-batches on the model's device
  double loss_scale_ = 0.0;
  std::map<MessageKey, Message> inbox_;   // received, or handed over locally on rank P - 1
  std::map<MessageKey, Message> outbox_;  // computed, waiting for the commit point that sends it
  std::deque<ChunkWork> weight_queue_;    // deferred backward_weight, FIFO
  std::vector<model::LossSum> losses_;    // loss stage, per micro-batch
  std::vector<double> router_table_;      // [n, layers, 3]: (load_balance, z_loss, device_balance) * tokens
  std::vector<model::RouterLossValues> router_values_;  // this rank's, read at the step's end
  std::vector<size_t> router_slots_;                    // each one's place in router_table_
};

}  // namespace moetrain::pipeline
