// defines: dualpipev_schedule, a line-by-line transcription of DualPipeV.step() from DeepSeek's dualpipev.py into a
// list of ops: the reference's compute calls become ops, its irecv/isend calls become the transfers of the op
// whose commit point (or whose compute) they fall before (after), and its weight-gradient queue is replayed so
// every Weight op names the backward it completes.
#include "pipeline/dualpipev_schedule.h"

#include <deque>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::pipeline {

int dualpipev_stage(int num_ranks, int rank, int chunk) {
  MT_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks && (chunk == 0 || chunk == 1),
           "dualpipev_stage: expected num_ranks >= 1, 0 <= rank < num_ranks and chunk 0 or 1, found num_ranks {}, "
           "rank {}, chunk {}",
           num_ranks, rank, chunk);
  return chunk == 0 ? rank : 2 * num_ranks - 1 - rank;
}

bool dualpipev_is_loss_chunk(int rank, int chunk) { return rank == 0 && chunk == 1; }

namespace {

// Emits one rank's ops the way dualpipev.py runs them. Method names follow the reference's helpers
// (_recv_forward, _forward_chunk, ...) so the two can be read side by side.
class ScheduleBuilder {
 public:
  ScheduleBuilder(int num_ranks, int rank) : num_ranks_(num_ranks), rank_(rank) {}

  void set_phase(int phase) { phase_ = phase; }

  // --- communication: a receive waits for the next commit point, a send follows the op just computed ---

  void recv_forward(int chunk) {
    if ((is_first_rank() && chunk == 0) || (is_last_rank() && chunk == 1)) return;  // stage 0's input, local hand-off
    const int peer = chunk == 0 ? rank_ - 1 : rank_ + 1;
    pending_recvs_.push_back({TransferKind::Activation, peer, chunk, recv_forward_count_[chunk]++});
  }

  void send_forward(int chunk) {
    if ((is_first_rank() && chunk == 1) || (is_last_rank() && chunk == 0)) return;  // the loss, local hand-off
    const int peer = chunk == 0 ? rank_ + 1 : rank_ - 1;
    last_op().sends.push_back({TransferKind::Activation, peer, chunk, send_forward_count_[chunk]++});
  }

  void recv_backward(int chunk) {
    if ((is_first_rank() && chunk == 1) || (is_last_rank() && chunk == 0)) return;  // the loss, local hand-off
    const int peer = chunk == 0 ? rank_ + 1 : rank_ - 1;
    pending_recvs_.push_back({TransferKind::Gradient, peer, chunk, recv_backward_count_[chunk]++});
  }

  void send_backward(int chunk) {
    if ((is_first_rank() && chunk == 0) || (is_last_rank() && chunk == 1)) return;  // stage 0, local hand-off
    const int peer = chunk == 0 ? rank_ - 1 : rank_ + 1;
    last_op().sends.push_back({TransferKind::Gradient, peer, chunk, send_backward_count_[chunk]++});
  }

  // --- compute: each call is one op; the receives posted since the last op are committed before it ---

  void forward_compute(int chunk) {
    PipelineOp& op = begin_op(OpKind::Forward);
    op.forward = {chunk, forward_count_[chunk]++};
  }

  void backward_compute(int chunk, bool defer_weight) {
    PipelineOp& op = begin_op(defer_weight ? OpKind::BackwardInput : OpKind::BackwardFull);
    op.backward = {chunk, backward_count_[chunk]++};
    if (defer_weight) weight_queue_.push_back(op.backward);
  }

  void forward_backward_compute(int forward_chunk, int backward_chunk) {
    PipelineOp& op = begin_op(OpKind::OverlappedPair);
    op.forward = {forward_chunk, forward_count_[forward_chunk]++};
    op.backward = {backward_chunk, backward_count_[backward_chunk]++};
  }

  // --- the reference's composite helpers ---

  void forward_chunk(int chunk, bool recv = true, bool send = true) {
    if (recv) recv_forward(chunk);
    forward_compute(chunk);
    if (send) send_forward(chunk);
  }

  void backward_chunk(int chunk, bool defer_weight = false, bool recv = true, bool send = true) {
    if (recv) recv_backward(chunk);
    backward_compute(chunk, defer_weight);
    if (send) send_backward(chunk);
  }

  void forward_backward_chunk(int forward_chunk, int backward_chunk, bool recv_forward_input = true) {
    if (recv_forward_input) recv_forward(forward_chunk);
    recv_backward(backward_chunk);
    forward_backward_compute(forward_chunk, backward_chunk);
    send_forward(forward_chunk);
    send_backward(backward_chunk);
  }

  void weight_chunk() {
    MT_CHECK(!weight_queue_.empty(), "dualpipev_schedule: rank {} phase {} runs a weight op with no deferred backward",
             rank_, phase_);
    PipelineOp& op = begin_op(OpKind::Weight);
    op.backward = weight_queue_.front();
    weight_queue_.pop_front();
  }

  bool is_first_rank() const { return rank_ == 0; }
  bool is_last_rank() const { return rank_ == num_ranks_ - 1; }

  std::vector<PipelineOp> finish() {
    MT_CHECK(pending_recvs_.empty() && weight_queue_.empty(),
             "dualpipev_schedule: rank {} ends with {} receives never committed and {} weight gradients never run",
             rank_, pending_recvs_.size(), weight_queue_.size());
    return std::move(ops_);
  }

 private:
  PipelineOp& begin_op(OpKind kind) {
    PipelineOp& op = ops_.emplace_back();
    op.kind = kind;
    op.phase = phase_;
    op.recvs = std::move(pending_recvs_);
    pending_recvs_.clear();
    return op;
  }

  PipelineOp& last_op() {
    MT_CHECK(!ops_.empty(), "dualpipev_schedule: rank {} posts a send before any compute", rank_);
    return ops_.back();
  }

  int num_ranks_;
  int rank_;
  int phase_ = 0;
  std::vector<PipelineOp> ops_;
  std::vector<Transfer> pending_recvs_;
  std::deque<ChunkWork> weight_queue_;
  // Per chunk: the next micro-batch to compute forward / backward, and the next one to receive / send each way.
  int forward_count_[2] = {0, 0};
  int backward_count_[2] = {0, 0};
  int recv_forward_count_[2] = {0, 0};
  int send_forward_count_[2] = {0, 0};
  int recv_backward_count_[2] = {0, 0};
  int send_backward_count_[2] = {0, 0};
};

}  // namespace

std::vector<PipelineOp> dualpipev_schedule(int num_ranks, int rank, int num_microbatches) {
  MT_CHECK(num_ranks >= 1, "dualpipev_schedule: num_ranks (pipeline ranks) must be >= 1, found {}", num_ranks);
  MT_CHECK(rank >= 0 && rank < num_ranks, "dualpipev_schedule: rank must be in [0, {}) for {} pipeline ranks, found {}",
           num_ranks, num_ranks, rank);
  MT_CHECK(num_microbatches >= 2 * num_ranks,
           "dualpipev_schedule: DualPipeV needs num_microbatches >= 2 * num_ranks = {} (one per stage of the V), found "
           "{}; use more micro-batches per step or fewer pipeline ranks",
           2 * num_ranks, num_microbatches);

  ScheduleBuilder b(num_ranks, rank);
  const int P = num_ranks;
  const int r = rank;

  // Step 1: nF0.
  b.set_phase(1);
  for (int i = 0; i < (P - r - 1) * 2; ++i) b.forward_chunk(0);

  // Step 2: nF0F1. The next chunk-0 input is received while chunk 1 runs; chunk 0's output leaves after it.
  b.set_phase(2);
  const int step_2 = r + 1;
  b.recv_forward(0);
  for (int i = 0; i < step_2; ++i) {
    b.forward_chunk(0, /*recv=*/false, /*send=*/false);
    b.recv_forward(0);
    b.forward_chunk(1, /*recv=*/true, /*send=*/!b.is_last_rank() || i < step_2 - 1);
    b.send_forward(0);
  }

  // Step 3: nB1W1F1, zero bubble: the weight gradient of each chunk-1 backward fills the wait for the next input.
  b.set_phase(3);
  for (int i = 0; i < P - r - 1; ++i) {
    b.backward_chunk(1, /*defer_weight=*/true);
    b.recv_forward(1);
    b.weight_chunk();
    b.forward_chunk(1, /*recv=*/false);
  }

  // Step 4 (main): nF0B1F1B0, overlapped forward & backward pairs.
  b.set_phase(4);
  const int step_4 = num_microbatches - P * 2 + r + 1;
  for (int i = 0; i < step_4; ++i) {
    if (i == 0) {
      if (b.is_last_rank()) {
        // The reference does not overlap these two, to shorten the bubble; the chunk-1 output held back at the end
        // of step 2 leaves after this forward.
        b.forward_chunk(0, /*recv=*/false, /*send=*/false);
        b.send_forward(1);
        b.backward_chunk(1, /*defer_weight=*/false, /*recv=*/true, /*send=*/false);
        b.send_forward(0);
        b.send_backward(1);
      } else {
        b.forward_backward_chunk(0, 1, /*recv_forward_input=*/false);
      }
    } else {
      b.forward_backward_chunk(0, 1);
    }
    b.forward_backward_chunk(1, 0);
  }

  // Step 5: nB1F1B0.
  b.set_phase(5);
  for (int i = 0; i < P - r - 1; ++i) {
    b.backward_chunk(1);
    b.forward_backward_chunk(1, 0);
  }

  // Step 6: nB1B0; from the middle on the weight gradients are deferred (zero bubble).
  b.set_phase(6);
  const int step_6 = r + 1;
  bool defer_weight = false;
  for (int i = 0; i < step_6; ++i) {
    if (i == step_6 / 2 && r % 2 == 1) defer_weight = true;
    b.backward_chunk(1, defer_weight);
    if (i == step_6 / 2 && r % 2 == 0) defer_weight = true;
    b.backward_chunk(0, defer_weight);
  }

  // Step 7: nWB0 (zero bubble).
  b.set_phase(7);
  for (int i = 0; i < P - r - 1; ++i) {
    b.weight_chunk();
    b.backward_chunk(0, /*defer_weight=*/true);
  }

  // Step 8: nW, the weight gradients still queued.
  b.set_phase(8);
  for (int i = 0; i < r + 1; ++i) b.weight_chunk();

  return b.finish();
}

std::string describe(const Transfer& t) {
  return fmt::format("{} c{} mb{}", t.kind == TransferKind::Activation ? "act" : "grad", t.chunk, t.microbatch);
}

std::string describe(const PipelineOp& op) {
  auto work = [](char what, const ChunkWork& w) { return fmt::format("{} c{} mb{}", what, w.chunk, w.microbatch); };
  std::string line = fmt::format("p{} ", op.phase);
  switch (op.kind) {
    case OpKind::Forward: line += work('F', op.forward); break;
    case OpKind::BackwardInput: line += work('B', op.backward) + " (input only, W deferred)"; break;
    case OpKind::BackwardFull: line += work('B', op.backward); break;
    case OpKind::Weight: line += work('W', op.backward); break;
    case OpKind::OverlappedPair: line += "pair " + work('F', op.forward) + " & " + work('B', op.backward); break;
  }
  auto list = [](const std::vector<Transfer>& transfers, const char* arrow) {
    std::string s;
    for (const Transfer& t : transfers) {
      if (!s.empty()) s += ", ";
      s += fmt::format("{} {} r{}", describe(t), arrow, t.peer);
    }
    return s;
  };
  if (!op.recvs.empty()) line += " | recv " + list(op.recvs, "<-");
  if (!op.sends.empty()) line += " | send " + list(op.sends, "->");
  return line;
}

std::array<PhaseOpCounts, 8> count_ops_per_phase(const std::vector<PipelineOp>& ops) {
  std::array<PhaseOpCounts, 8> counts{};
  for (const PipelineOp& op : ops) {
    MT_CHECK(op.phase >= 1 && op.phase <= 8, "count_ops_per_phase: op '{}' has phase {}, expected 1..8", describe(op),
             op.phase);
    PhaseOpCounts& c = counts[static_cast<size_t>(op.phase - 1)];
    switch (op.kind) {
      case OpKind::Forward: ++c.forward; break;
      case OpKind::BackwardInput: ++c.backward_input; break;
      case OpKind::BackwardFull: ++c.backward_full; break;
      case OpKind::Weight: ++c.weight; break;
      case OpKind::OverlappedPair: ++c.overlapped_pair; break;
    }
  }
  return counts;
}

}  // namespace moetrain::pipeline
