// defines: ExpertParallelPlan, expert parallelism's stage 2 (dispatch) and stage 4 (combine) of one MoE layer for
// one micro-batch (docs/design.md section 3), and their backwards, as all-to-all-v over the ep communicator. Every ep
// rank holds the whole expert bank's weights but computes only its E / ep consecutive experts: dispatch sends each
// expert-ordered row to the rank owning its expert, combine brings the expert outputs back in the original order.
//
// Row orders. A rank's dispatched rows are expert-ordered (rank q's experts are one contiguous block of them), so the
// rank sends one block per destination. The receiver reorders what arrives from (source rank, expert) order into
// (expert, source rank) order, so that stage 3 sees expert-ordered rows with `local_group_offsets()` [E + 1], in
// which the other ranks' experts have 0 rows: the grouped GEMM runs unchanged and the gradients of experts this rank
// does not own stay 0 here (the trainer's gradient all-reduce over dp x ep then sums each expert's gradient from its
// owner only). Within an expert the rows of source rank 0 come first, then rank 1, ... (deterministic).
//
// Split sizes: the plan exchanges every rank's group offsets with one small all_gather and copies them to the host
// once; the backward reuses the plan. Dropless: every row reaches its expert. No de-duplication: a token routed to
// two experts of the same rank travels twice.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "dist/communicator.h"

namespace moetrain::dist {

class ExpertParallelPlan {
 public:
  ExpertParallelPlan() = default;

  // Collective over `ep` (every ep rank calls it, in the same order of layers and micro-batches): all_gathers each
  // rank's `group_offsets` (i32 [E + 1] on the communicator's device: rows per expert of its dispatched rows) and
  // copies them to the host once. `num_experts` (E) must be divisible by ep.size().
  static ExpertParallelPlan create(Communicator& ep, Stream& stream, const Tensor& group_offsets, int64_t num_experts);
  // The same from every rank's offsets already on the host: all_offsets[p * (E + 1) + e] is rank p's offset e. No
  // communication; the local group offsets are made on `device`.
  static ExpertParallelPlan from_offsets(int ep_size, int ep_rank, int64_t num_experts,
                                         const std::vector<int64_t>& all_offsets, Device device = Device::cpu());

  bool defined() const { return ep_size_ > 0; }
  int ep_size() const { return ep_size_; }
  int ep_rank() const { return ep_rank_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t local_experts() const { return num_experts_ / ep_size_; }  // E / ep, experts [rank * El, (rank + 1) * El)
  int64_t dispatched_rows() const { return dispatched_rows_; }       // R: this rank's rows before dispatch
  int64_t local_rows() const { return local_rows_; }                 // rows this rank's experts compute
  // Rows this rank sends to / receives from each ep rank in dispatch (combine swaps them).
  const std::vector<int64_t>& send_rows() const { return send_rows_; }
  const std::vector<int64_t>& recv_rows() const { return recv_rows_; }
  // i32 [E + 1] offsets of the rows after dispatch: 0 rows for the experts of other ranks.
  const Tensor& local_group_offsets() const { return local_group_offsets_; }
  const std::vector<int64_t>& local_offsets_host() const { return local_offsets_; }

  // Stage 2: [R, ...] expert-ordered rows of this rank -> [local_rows, ...] rows of this rank's experts.
  Tensor dispatch(Communicator& ep, Stream& stream, const Tensor& dispatched) const;
  // Stage 4: [local_rows, ...] expert outputs -> [R, ...] in the order of this rank's dispatched rows.
  Tensor combine(Communicator& ep, Stream& stream, const Tensor& expert_out) const;
  // Backward of stage 4 (its transpose, the same movement as dispatch): [R, ...] -> [local_rows, ...].
  Tensor combine_backward(Communicator& ep, Stream& stream, const Tensor& d_combined) const;
  // Backward of stage 2 (its transpose, the same movement as combine): [local_rows, ...] -> [R, ...].
  Tensor dispatch_backward(Communicator& ep, Stream& stream, const Tensor& d_local) const;

 private:
  // One (source rank, local expert) block: where it sits in the received buffer and in the expert-ordered rows.
  struct Block {
    int64_t received_begin = 0, local_begin = 0, rows = 0;
  };

  void check_call(const Communicator& ep, const Tensor& t, int64_t rows, const char* op, const char* what) const;
  Tensor forward_movement(Communicator& ep, Stream& stream, const Tensor& rows) const;   // dispatch
  Tensor backward_movement(Communicator& ep, Stream& stream, const Tensor& rows) const;  // combine

  int ep_size_ = 0, ep_rank_ = 0;
  int64_t num_experts_ = 0;
  int64_t dispatched_rows_ = 0, local_rows_ = 0;
  std::vector<int64_t> send_rows_, recv_rows_;
  std::vector<int64_t> local_offsets_;
  std::vector<Block> blocks_;
  bool reorder_ = false;  // false when (source, expert) order is already (expert, source) order
  Tensor local_group_offsets_;
};

}  // namespace moetrain::dist
