// defines: the DualPipeV pipeline schedule as a pure function: for one of P ranks and n micro-batches, the ordered
// list of compute ops (forward, backward, deferred weight gradient, overlapped forward & backward pairs), each with the
// point-to-point messages posted around it. It mirrors DeepSeek's dualpipev.py step() phase by phase and message by
// message, so the executor walks the list and decides nothing itself; the tests run every rank's list together.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace moetrain::pipeline {

// The V: P ranks hold 2P stages. Chunk 0 of rank r is stage r (going down), chunk 1 is stage 2P - 1 - r (coming
// back). Data crossing ranks keeps its chunk: chunk 0's forward output goes to rank r + 1 (its gradient comes back
// from there), chunk 1's forward output goes to rank r - 1. Two hand-offs are local and carry no message: on rank
// P - 1 chunk 0's output is chunk 1's input (and chunk 1's input gradient is chunk 0's output gradient); on rank 0
// chunk 1 is the last stage, whose forward ends in the loss and whose backward starts from it.
int dualpipev_stage(int num_ranks, int rank, int chunk);
// True for (rank 0, chunk 1): the stage that computes the loss.
bool dualpipev_is_loss_chunk(int rank, int chunk);

enum class OpKind : uint8_t {
  Forward,         // forward of one chunk for one micro-batch
  BackwardInput,   // backward_input only; its backward_weight is queued for a later Weight op (zero bubble)
  BackwardFull,    // backward_input and backward_weight together
  Weight,          // runs the oldest queued backward_weight (the queue is FIFO)
  OverlappedPair,  // forward of one (chunk, micro-batch) overlapped with the full backward of another
};

enum class TransferKind : uint8_t {
  Activation,  // a forward output, the next stage's input
  Gradient,    // the gradient of a stage's input, the previous stage's output gradient
};

// One point-to-point message. `peer` is the source of a receive and the destination of a send; chunk and
// micro-batch name the data and are the same on both ends (see the V above).
struct Transfer {
  TransferKind kind = TransferKind::Activation;
  int peer = 0;
  int chunk = 0;
  int microbatch = 0;

  bool operator==(const Transfer&) const = default;
};

// One chunk's work on one micro-batch; chunk < 0 means none.
struct ChunkWork {
  int chunk = -1;
  int microbatch = -1;

  bool valid() const { return chunk >= 0; }
  bool operator==(const ChunkWork&) const = default;
};

// One step of a rank's schedule.
//
// Communication follows dualpipev.py's commit points exactly: before op k the executor posts op k-1's `sends`
// together with op k's `recvs` as one batch (batch_isend_irecv) and waits for all of it, then computes op k; after
// the last op it commits that op's sends alone. A receive may be for a later op's input (posted early, as the
// reference does) and a send may carry an earlier op's output (held back, as the reference does): messages name
// their chunk and micro-batch, so the executor files them by name, never by position. Within one (source,
// destination) pair messages are matched in posting order.
struct PipelineOp {
  OpKind kind = OpKind::Forward;
  int phase = 0;       // 1..8, the step of DualPipeV that emitted it
  ChunkWork forward;   // Forward and OverlappedPair
  ChunkWork backward;  // BackwardInput, BackwardFull, OverlappedPair; for Weight, whose backward_weight it runs
  std::vector<Transfer> recvs;  // posted before the compute, waited on before it starts
  std::vector<Transfer> sends;  // posted after the compute
};

// The op list of `rank` for one optimizer step of `num_microbatches` micro-batches over `num_ranks` pipeline ranks.
// Phases, with s = num_microbatches - 2 * num_ranks + rank + 1 (DualPipeV's main-step count):
//   1 nF0          2 (P - r - 1) forwards of chunk 0
//   2 nF0F1        r + 1 times: forward chunk 0, forward chunk 1
//   3 nB1W1F1      P - r - 1 times: backward_input chunk 1, weight, forward chunk 1
//   4 nF0B1F1B0    s times: pair (F chunk 0, B chunk 1), pair (F chunk 1, B chunk 0); on rank P - 1 the very first
//                  pair runs as a plain forward then a plain full backward
//   5 nB1F1B0      P - r - 1 times: full backward chunk 1, pair (F chunk 1, B chunk 0)
//   6 nB1B0        r + 1 times: backward chunk 1, backward chunk 0; from the middle on the backward_weight is
//                  deferred (r + 1 of the 2 (r + 1) backwards are BackwardInput)
//   7 nWB0         P - r - 1 times: weight, backward_input chunk 0
//   8 nW           r + 1 weights
// Requires num_ranks >= 1, 0 <= rank < num_ranks and num_microbatches >= 2 * num_ranks (any parity).
std::vector<PipelineOp> dualpipev_schedule(int num_ranks, int rank, int num_microbatches);

// One line for logs and test messages, e.g.
// "p4 pair F c0 mb5 & B c1 mb3 | recv act c0 mb5 <- r1, grad c1 mb3 <- r1 | send act c0 mb5 -> r3, grad c1 mb3 -> r3"
// on rank 2.
std::string describe(const PipelineOp& op);
std::string describe(const Transfer& transfer);

struct PhaseOpCounts {
  int forward = 0;
  int backward_input = 0;
  int backward_full = 0;
  int weight = 0;
  int overlapped_pair = 0;

  int total() const { return forward + backward_input + backward_full + weight + overlapped_pair; }
  bool operator==(const PhaseOpCounts&) const = default;
};

// Ops of each kind per phase; index 0 is phase 1.
std::array<PhaseOpCounts, 8> count_ops_per_phase(const std::vector<PipelineOp>& ops);

}  // namespace moetrain::pipeline
