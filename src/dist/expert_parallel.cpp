// defines: the expert-parallel exchange plan and its four transfers (all-to-all-v plus block reordering).
#include "dist/expert_parallel.h"

#include <limits>

#include "core/error.h"

namespace moetrain::dist {

namespace {

Tensor rows_like(const Tensor& t, int64_t rows) {
  Shape shape = t.shape();
  shape[0] = rows;
  return Tensor::empty(shape, t.dtype(), t.device());
}

}  // namespace

ExpertParallelPlan ExpertParallelPlan::create(Communicator& ep, Stream& stream, const Tensor& group_offsets,
                                              int64_t num_experts) {
  MT_CHECK(num_experts > 0 && num_experts % ep.size() == 0,
           "expert parallel: num_experts ({}) must be positive and divisible by the size of communicator '{}' ({})",
           num_experts, ep.name(), ep.size());
  expect_defined(group_offsets, "expert parallel: group_offsets");
  expect_dtype(group_offsets, DType::I32, "expert parallel: group_offsets");
  expect_shape(group_offsets, {num_experts + 1}, "expert parallel: group_offsets");
  expect_contiguous(group_offsets, "expert parallel: group_offsets");
  Tensor gathered =
      Tensor::empty({static_cast<int64_t>(ep.size()), num_experts + 1}, DType::I32, group_offsets.device());
  ep.all_gather(stream, gathered, group_offsets);
  const std::vector<int32_t> host = gathered.to_vector<int32_t>();  // the one copy to the host
  return from_offsets(ep.size(), ep.rank(), num_experts, std::vector<int64_t>(host.begin(), host.end()),
                      group_offsets.device());
}

ExpertParallelPlan ExpertParallelPlan::from_offsets(int ep_size, int ep_rank, int64_t num_experts,
                                                    const std::vector<int64_t>& all_offsets, Device device) {
  MT_CHECK(ep_size > 0 && ep_rank >= 0 && ep_rank < ep_size,
           "expert parallel: rank {} is not a rank of an ep group of size {}", ep_rank, ep_size);
  MT_CHECK(num_experts > 0 && num_experts % ep_size == 0,
           "expert parallel: num_experts ({}) must be positive and divisible by ep ({})", num_experts, ep_size);
  const int64_t E = num_experts;
  MT_CHECK(static_cast<int64_t>(all_offsets.size()) == ep_size * (E + 1),
           "expert parallel: expected ep ({}) x (num_experts + 1) ({}) = {} group offsets, found {}", ep_size, E + 1,
           ep_size * (E + 1), all_offsets.size());
  auto offset = [&](int p, int64_t e) { return all_offsets[static_cast<size_t>(p * (E + 1) + e)]; };
  auto count = [&](int p, int64_t e) { return offset(p, e + 1) - offset(p, e); };
  for (int p = 0; p < ep_size; ++p) {
    MT_CHECK(offset(p, 0) == 0, "expert parallel: ep rank {}'s group offsets must start at 0; found {}", p,
             offset(p, 0));
    for (int64_t e = 0; e < E; ++e) {
      MT_CHECK(count(p, e) >= 0,
               "expert parallel: ep rank {}'s group offsets must not decrease; found offsets[{}] = {} > offsets[{}] = "
               "{}",
               p, e, offset(p, e), e + 1, offset(p, e + 1));
    }
  }

  ExpertParallelPlan plan;
  plan.ep_size_ = ep_size;
  plan.ep_rank_ = ep_rank;
  plan.num_experts_ = E;
  plan.dispatched_rows_ = offset(ep_rank, E);
  const int64_t El = E / ep_size;
  const int64_t first = ep_rank * El;  // this rank's experts: [first, first + El)
  plan.send_rows_.resize(static_cast<size_t>(ep_size));
  plan.recv_rows_.resize(static_cast<size_t>(ep_size));
  for (int q = 0; q < ep_size; ++q) {
    plan.send_rows_[static_cast<size_t>(q)] = offset(ep_rank, (q + 1) * El) - offset(ep_rank, q * El);
    plan.recv_rows_[static_cast<size_t>(q)] = offset(q, first + El) - offset(q, first);
  }

  // Expert-ordered local rows: expert e holds every source's rows of e, source 0 first.
  plan.local_offsets_.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) {
    int64_t rows = 0;
    if (e >= first && e < first + El) {
      for (int p = 0; p < ep_size; ++p) rows += count(p, e);
    }
    plan.local_offsets_[static_cast<size_t>(e + 1)] = plan.local_offsets_[static_cast<size_t>(e)] + rows;
  }
  plan.local_rows_ = plan.local_offsets_.back();
  MT_CHECK(plan.local_rows_ <= std::numeric_limits<int32_t>::max(),
           "expert parallel: ep rank {} would receive {} rows, more than i32 group offsets can hold", ep_rank,
           plan.local_rows_);

  // Blocks: in the received buffer source p's rows come in expert order; locally, (expert, source) order.
  int64_t received_base = 0;
  for (int p = 0; p < ep_size; ++p) {
    int64_t within = 0;
    for (int64_t j = 0; j < El; ++j) {
      const int64_t e = first + j;
      int64_t before = 0;  // rows of e from sources before p
      for (int s = 0; s < p; ++s) before += count(s, e);
      const Block b{received_base + within, plan.local_offsets_[static_cast<size_t>(e)] + before, count(p, e)};
      if (b.rows > 0) {
        plan.blocks_.push_back(b);
        plan.reorder_ = plan.reorder_ || b.received_begin != b.local_begin;
      }
      within += count(p, e);
    }
    received_base += plan.recv_rows_[static_cast<size_t>(p)];
  }

  std::vector<int32_t> local32(plan.local_offsets_.begin(), plan.local_offsets_.end());
  Tensor host = Tensor::from_vector(local32, {E + 1});
  plan.local_group_offsets_ = device.is_cpu() ? host : host.to(device);
  return plan;
}

void ExpertParallelPlan::check_call(const Communicator& ep, const Tensor& t, int64_t rows, const char* op,
                                    const char* what) const {
  MT_CHECK(defined(), "expert parallel: {} with a plan that was never made", op);
  MT_CHECK(ep.size() == ep_size_ && ep.rank() == ep_rank_,
           "expert parallel: {} on communicator '{}' (rank {} of {}) but the plan was made for rank {} of {}", op,
           ep.name(), ep.rank(), ep.size(), ep_rank_, ep_size_);
  expect_defined(t, what);
  expect_contiguous(t, what);
  MT_CHECK(t.dim() >= 1 && t.size(0) == rows,
           "expert parallel: {}: {} must have {} rows (the plan's) along dim 0; found {}", op, what, rows,
           t.describe());
}

Tensor ExpertParallelPlan::forward_movement(Communicator& ep, Stream& stream, const Tensor& rows) const {
  Tensor received = rows_like(rows, local_rows_);
  ep.all_to_all_v(stream, received, recv_rows_, rows, send_rows_);
  if (!reorder_) return received;
  Tensor out = rows_like(rows, local_rows_);
  for (const Block& b : blocks_) {
    out.slice(b.local_begin, b.local_begin + b.rows)
        .copy_from(received.slice(b.received_begin, b.received_begin + b.rows));
  }
  return out;
}

Tensor ExpertParallelPlan::backward_movement(Communicator& ep, Stream& stream, const Tensor& rows) const {
  Tensor to_send = rows;
  if (reorder_) {
    to_send = rows_like(rows, local_rows_);
    for (const Block& b : blocks_) {
      to_send.slice(b.received_begin, b.received_begin + b.rows)
          .copy_from(rows.slice(b.local_begin, b.local_begin + b.rows));
    }
  }
  Tensor out = rows_like(rows, dispatched_rows_);
  ep.all_to_all_v(stream, out, send_rows_, to_send, recv_rows_);
  return out;
}

Tensor ExpertParallelPlan::dispatch(Communicator& ep, Stream& stream, const Tensor& dispatched) const {
  check_call(ep, dispatched, dispatched_rows_, "dispatch", "dispatched rows");
  return forward_movement(ep, stream, dispatched);
}

Tensor ExpertParallelPlan::combine(Communicator& ep, Stream& stream, const Tensor& expert_out) const {
  check_call(ep, expert_out, local_rows_, "combine", "expert output rows");
  return backward_movement(ep, stream, expert_out);
}

Tensor ExpertParallelPlan::combine_backward(Communicator& ep, Stream& stream, const Tensor& d_combined) const {
  check_call(ep, d_combined, dispatched_rows_, "combine backward", "combined-row gradient");
  return forward_movement(ep, stream, d_combined);
}

Tensor ExpertParallelPlan::dispatch_backward(Communicator& ep, Stream& stream, const Tensor& d_local) const {
  check_call(ep, d_local, local_rows_, "dispatch backward", "local-row gradient");
  return backward_movement(ep, stream, d_local);
}

}  // namespace moetrain::dist
