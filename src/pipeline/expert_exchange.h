// defines: ExpertExchange, expert parallelism's stage 2 (dispatch) and stage 4 (combine) of one MoE layer for one
// micro-batch with a de-duplicated dispatch: each token travels once to each ep rank that hosts any of its selected
// experts and is expanded into its expert-ordered copies there (dropless). It keeps dist::ExpertParallelPlan's local
// row layout (expert, then source rank, then the source's row order; local_group_offsets() [E + 1]), so stage 3 is
// unchanged, and its combine, combine backward and dispatch backward are the plan's (one row per (token, expert)
// back to the source: stage 1's backward sums a token's copies in its fixed order, so gradients are the same bits as
// without de-duplication).
//
// Dispatch: this rank's expert-ordered rows [R, H] (row r holds choice row_choice[r] = t * K + k, i.e. a copy of
// token t) -> gather_rows: per destination q, one row per unique token routed to q, ascending token order ->
// all_to_all_v -> gather_rows: the receiver expands the unique rows into the plan's local rows.
//
// Host synchronisation: one read per layer and micro-batch, in create(). The unique tokens per destination are
// counted on the device (ops::count_tokens_per_rank) and travel in the same all_gather as the group offsets, so
// after that one read every rank knows every split size; the sender builds its send indices and each row's index in
// its destination's received buffer on the host, and those indices reach the receiver through the plan's own
// dispatch (an i32 column), on the device. The four movements never synchronise with the host.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "dist/expert_parallel.h"

namespace moetrain::pipeline {

class ExpertExchange {
 public:
  ExpertExchange() = default;

  // Collective over `ep` (every ep rank calls it, in the same order of layers and micro-batches). group_offsets:
  // i32 [E + 1], rows per expert of this rank's dispatched rows (ops::RoutingPlan::expert_offsets); row_choice: i32
  // [R] with R = group_offsets[E], the flat choice t * K + k of each dispatched row (ops::RoutingPlan::row_choice);
  // topk_index: i32 [T, K] the router's choices (T * K = R); all on the communicator's device. `num_experts` must be
  // divisible by ep.size(). `deduplicate` false: every (token, expert) row travels, as dist::ExpertParallelPlan sends
  // them (no index building on the host), for links where latency costs more than bytes.
  static ExpertExchange create(dist::Communicator& ep, Stream& stream, const Tensor& group_offsets,
                               const Tensor& row_choice, const Tensor& topk_index, int64_t num_experts,
                               bool deduplicate = true);

  bool defined() const { return plan_.defined(); }
  const dist::ExpertParallelPlan& plan() const { return plan_; }  // the row counts and the combine path
  // i32 [E + 1] offsets of the local rows (the plan's): 0 rows for the experts of other ranks.
  const Tensor& local_group_offsets() const { return plan_.local_group_offsets(); }
  int64_t dispatched_rows() const { return plan_.dispatched_rows(); }  // R
  int64_t local_rows() const { return plan_.local_rows(); }            // rows this rank's experts compute

  // Rows dispatch sends to each ep rank (unique tokens, rank order), what the plan would send (one per row), and
  // the unique rows this rank receives from each ep rank.
  const std::vector<int64_t>& unique_send_rows() const { return unique_send_rows_; }
  const std::vector<int64_t>& send_rows() const { return plan_.send_rows(); }
  const std::vector<int64_t>& unique_recv_rows() const { return unique_recv_rows_; }

  // Stage 2: [R, H] expert-ordered rows of this rank -> [local_rows, H] rows of this rank's experts. The rows of one
  // token must be equal (copies), as stage 1 makes them: only the first of them per destination is sent.
  Tensor dispatch(dist::Communicator& ep, Stream& stream, const Tensor& dispatched) const;
  // Stage 4 (the plan's): [local_rows, H] expert outputs -> [R, H] in the order of this rank's dispatched rows.
  Tensor combine(dist::Communicator& ep, Stream& stream, const Tensor& expert_out) const;
  // Backward of stage 4 (the plan's): [R, H] -> [local_rows, H].
  Tensor combine_backward(dist::Communicator& ep, Stream& stream, const Tensor& d_combined) const;
  // Backward of stage 2 (the plan's): [local_rows, H] -> [R, H], each local row's gradient back on its source row.
  Tensor dispatch_backward(dist::Communicator& ep, Stream& stream, const Tensor& d_local) const;

 private:
  void check_call(const dist::Communicator& ep, const Tensor& t, int64_t rows, const char* op, const char* what) const;

  dist::ExpertParallelPlan plan_;
  bool deduplicate_ = true;
  std::vector<int64_t> unique_send_rows_, unique_recv_rows_;
  int64_t unique_send_total_ = 0, unique_recv_total_ = 0;
  Tensor send_index_;    // i32 [unique_send_total]: the dispatched row sent for each (destination, unique token)
  Tensor expand_index_;  // i32 [local_rows]: the received unique row each local row copies
};

}  // namespace moetrain::pipeline
