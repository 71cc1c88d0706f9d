// defines: the de-duplicated expert exchange: building its index tensors on the host at create (send side from
// row_choice, receive side from the positions the plan's dispatch delivers) and its four movements.
#include "pipeline/expert_exchange.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

#include "core/error.h"
#include "ops/row_gather.h"

namespace moetrain::pipeline {

namespace {

// An i32 vector on `device` (the index tensors are made on the host once, at create).
Tensor index_tensor(const std::vector<int32_t>& values, Device device) {
  Tensor host = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
  return device.is_cpu() ? host : host.to(device);
}

int32_t to_i32(int64_t v) { return static_cast<int32_t>(v); }

}  // namespace

ExpertExchange ExpertExchange::create(dist::Communicator& ep, Stream& stream, const Tensor& group_offsets,
                                      const Tensor& row_choice, const Tensor& topk_index, int64_t num_experts,
                                      bool deduplicate) {
  if (!deduplicate) {  // one row per (token, expert): the plan alone
    ExpertExchange x;
    x.plan_ = dist::ExpertParallelPlan::create(ep, stream, group_offsets, num_experts);
    x.deduplicate_ = false;
    x.unique_send_rows_ = x.plan_.send_rows();
    x.unique_recv_rows_ = x.plan_.recv_rows();
    return x;
  }
  MT_CHECK(num_experts > 0 && num_experts % ep.size() == 0,
           "expert exchange: num_experts ({}) must be positive and divisible by the size of communicator '{}' ({})",
           num_experts, ep.name(), ep.size());
  expect_defined(group_offsets, "expert exchange: group_offsets");
  expect_dtype(group_offsets, DType::I32, "expert exchange: group_offsets");
  expect_shape(group_offsets, {num_experts + 1}, "expert exchange: group_offsets");
  expect_contiguous(group_offsets, "expert exchange: group_offsets");
  expect_defined(row_choice, "expert exchange: row_choice");
  expect_dtype(row_choice, DType::I32, "expert exchange: row_choice");
  expect_contiguous(row_choice, "expert exchange: row_choice");
  MT_CHECK(row_choice.dim() == 1, "expert exchange: expected row_choice i32 [R] but found {}", row_choice.describe());
  expect_defined(topk_index, "expert exchange: topk_index");
  MT_CHECK(
      topk_index.dim() == 2 && topk_index.size(1) > 0 && topk_index.size(0) * topk_index.size(1) == row_choice.size(0),
      "expert exchange: expected topk_index i32 [T, K] with T * K = {} (one entry per dispatched row) but found {}",
      row_choice.size(0), topk_index.describe());
  expect_same_device(row_choice, group_offsets, "expert exchange: row_choice and group_offsets");
  expect_same_device(topk_index, group_offsets, "expert exchange: topk_index and group_offsets");
  const Device device = group_offsets.device();
  const int n = ep.size(), me = ep.rank();
  const int64_t E = num_experts, El = E / n, top_k = topk_index.size(1);

  // The one host read: every rank's group offsets and its unique tokens per destination (counted on the device,
  // so they travel in the same all_gather), and this rank's row_choice.
  Tensor mine = Tensor::empty({E + 1 + n}, DType::I32, device);
  mine.slice(0, E + 1).copy_from(group_offsets);
  ops::count_tokens_per_rank(stream, mine.slice(E + 1, E + 1 + n), topk_index, El);
  Tensor gathered = Tensor::empty({static_cast<int64_t>(n), E + 1 + n}, DType::I32, device);
  ep.all_gather(stream, gathered, mine);
  const std::vector<int32_t> all32 = gathered.to_vector<int32_t>();
  const std::vector<int32_t> choice = row_choice.to_vector<int32_t>();
  std::vector<int64_t> all;  // offsets only, as the plan takes them
  for (int p = 0; p < n; ++p) {
    const auto row = all32.begin() + static_cast<std::ptrdiff_t>(p) * (E + 1 + n);
    all.insert(all.end(), row, row + E + 1);
  }
  auto unique_count = [&](int p, int q) {
    return static_cast<int64_t>(all32[static_cast<size_t>(p * (E + 1 + n) + E + 1 + q)]);
  };
  ExpertExchange x;
  x.plan_ = dist::ExpertParallelPlan::from_offsets(n, me, E, all, device);
  auto offset = [&](int p, int64_t e) { return all[static_cast<size_t>(p * (E + 1) + e)]; };
  const int64_t R = x.plan_.dispatched_rows();
  // A rank-local refusal from here on leaves the other ranks in the next collective (as a bad row count does with
  // the plan): the in-process backend aborts them, NCCL's watchdog times out. Stage 1 makes consistent inputs.
  MT_CHECK(row_choice.size(0) == R,
           "expert exchange: row_choice must have one entry per dispatched row, group_offsets[E] = {}; found {}", R,
           row_choice.describe());

  // Receive side: source p's unique rows for this rank come in p's order, after those of the sources before it.
  x.unique_recv_rows_.assign(static_cast<size_t>(n), 0);
  for (int p = 0; p < n; ++p) x.unique_recv_rows_[static_cast<size_t>(p)] = unique_count(p, me);
  x.unique_recv_total_ = std::accumulate(x.unique_recv_rows_.begin(), x.unique_recv_rows_.end(), int64_t{0});

  // Send side: per destination q (its experts' rows are [begin, end)), the unique tokens in ascending order; each is
  // sent as the first of its rows, and every row learns where its token lands in q's received buffer (after the
  // unique rows of the sources before this one), which is the index q expands it from.
  std::vector<int32_t> position(static_cast<size_t>(R));
  std::vector<int32_t> send_index;
  x.unique_send_rows_.assign(static_cast<size_t>(n), 0);
  // Linear in rows and tokens (no sort): per destination, mark the tokens present and each one's first row, then
  // number them in ascending token order.
  const int64_t T = topk_index.size(0);
  std::vector<int32_t> stamp(static_cast<size_t>(T), -1), first_row(static_cast<size_t>(T)),
      slot(static_cast<size_t>(T));
  for (int q = 0; q < n; ++q) {
    int64_t base = 0;
    for (int p = 0; p < me; ++p) base += unique_count(p, q);
    const int64_t begin = offset(me, q * El), end = offset(me, (q + 1) * El);
    for (int64_t r = begin; r < end; ++r) {
      const int32_t c = choice[static_cast<size_t>(r)];
      MT_CHECK(c >= 0 && c / top_k < T, "expert exchange: row_choice[{}] = {} is outside [0, T * K = {})", r, c,
               T * top_k);
      const size_t t = static_cast<size_t>(c / top_k);
      if (stamp[t] != q) {
        stamp[t] = q;
        first_row[t] = to_i32(r);
      }
    }
    int64_t unique = 0;
    for (size_t t = 0; t < static_cast<size_t>(T); ++t) {
      if (stamp[t] != q) continue;
      slot[t] = to_i32(base + unique++);
      send_index.push_back(first_row[t]);
    }
    for (int64_t r = begin; r < end; ++r)
      position[static_cast<size_t>(r)] = slot[static_cast<size_t>(choice[static_cast<size_t>(r)] / top_k)];
    MT_CHECK(unique == unique_count(me, q),
             "expert exchange: ep rank {} routes {} unique tokens to rank {} by row_choice but {} by topk_index; the "
             "two must describe the same routing",
             me, unique, q, unique_count(me, q));
    x.unique_send_rows_[static_cast<size_t>(q)] = unique;
  }
  x.unique_send_total_ = static_cast<int64_t>(send_index.size());
  x.send_index_ = index_tensor(send_index, device);
  // The expand indices travel with the plan's own dispatch, as an i32 column: they arrive in the local layout, on
  // the device, and are never read by the host.
  const Tensor position_host = Tensor::from_vector(position, {R, 1});
  x.expand_index_ = x.plan_.dispatch(ep, stream, device.is_cpu() ? position_host : position_host.to(device)).view({-1});
  return x;
}

void ExpertExchange::check_call(const dist::Communicator& ep, const Tensor& t, int64_t rows, const char* op,
                                const char* what) const {
  MT_CHECK(defined(), "expert exchange: {} with an exchange that was never made", op);
  MT_CHECK(ep.size() == plan_.ep_size() && ep.rank() == plan_.ep_rank(),
           "expert exchange: {} on communicator '{}' (rank {} of {}) but the exchange was made for rank {} of {}", op,
           ep.name(), ep.rank(), ep.size(), plan_.ep_rank(), plan_.ep_size());
  expect_defined(t, what);
  expect_contiguous(t, what);
  MT_CHECK(t.dim() == 2 && t.size(0) == rows,
           "expert exchange: {}: expected {} [{}, H] (the exchange's rows); found {}", op, what, rows, t.describe());
}

Tensor ExpertExchange::dispatch(dist::Communicator& ep, Stream& stream, const Tensor& dispatched) const {
  check_call(ep, dispatched, dispatched_rows(), "dispatch", "dispatched rows");
  if (!deduplicate_) return plan_.dispatch(ep, stream, dispatched);
  const int64_t H = dispatched.size(1);
  Tensor unique = Tensor::empty({unique_send_total_, H}, dispatched.dtype(), dispatched.device());
  ops::gather_rows(stream, unique, dispatched, send_index_);
  Tensor received = Tensor::empty({unique_recv_total_, H}, dispatched.dtype(), dispatched.device());
  ep.all_to_all_v(stream, received, unique_recv_rows_, unique, unique_send_rows_);
  Tensor local = Tensor::empty({local_rows(), H}, dispatched.dtype(), dispatched.device());
  ops::gather_rows(stream, local, received, expand_index_);
  return local;
}

Tensor ExpertExchange::combine(dist::Communicator& ep, Stream& stream, const Tensor& expert_out) const {
  check_call(ep, expert_out, local_rows(), "combine", "expert output rows");
  return plan_.combine(ep, stream, expert_out);
}

Tensor ExpertExchange::combine_backward(dist::Communicator& ep, Stream& stream, const Tensor& d_combined) const {
  check_call(ep, d_combined, dispatched_rows(), "combine backward", "combined-row gradient");
  return plan_.combine_backward(ep, stream, d_combined);
}

Tensor ExpertExchange::dispatch_backward(dist::Communicator& ep, Stream& stream, const Tensor& d_local) const {
  check_call(ep, d_local, local_rows(), "dispatch backward", "local-row gradient");
  // Every local row's gradient goes back to its source row (the plan's movement): stage 1's backward sums a token's
  // copies in its fixed order, so the gradient is the same bits as without de-duplication.
  return plan_.dispatch_backward(ep, stream, d_local);
}

}  // namespace moetrain::pipeline
