// defines: the de-duplicated expert exchange: building its index tensors on the host at create (send side from
// row_choice, receive side from the positions the plan's dispatch delivers) and its four movements.
#include "pipeline/expert_exchange.h"

#include <algorithm>
#include <limits>
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
                                      const Tensor& row_choice, int64_t top_k, int64_t num_experts, bool deduplicate) {
  if (!deduplicate) {  // one row per (token, expert): the plan alone, one host read
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
  MT_CHECK(top_k > 0, "expert exchange: top_k must be positive; found {}", top_k);
  expect_defined(group_offsets, "expert exchange: group_offsets");
  expect_dtype(group_offsets, DType::I32, "expert exchange: group_offsets");
  expect_shape(group_offsets, {num_experts + 1}, "expert exchange: group_offsets");
  expect_contiguous(group_offsets, "expert exchange: group_offsets");
  expect_defined(row_choice, "expert exchange: row_choice");
  expect_dtype(row_choice, DType::I32, "expert exchange: row_choice");
  expect_contiguous(row_choice, "expert exchange: row_choice");
  MT_CHECK(row_choice.dim() == 1, "expert exchange: expected row_choice i32 [R] but found {}", row_choice.describe());
  expect_same_device(row_choice, group_offsets, "expert exchange: row_choice and group_offsets");
  const Device device = group_offsets.device();
  const int n = ep.size(), me = ep.rank();
  const int64_t E = num_experts, El = E / n;

  // Host read 1: every rank's group offsets (the plan's all_gather) and this rank's row_choice.
  Tensor gathered = Tensor::empty({static_cast<int64_t>(n), E + 1}, DType::I32, device);
  ep.all_gather(stream, gathered, group_offsets);
  const std::vector<int32_t> all32 = gathered.to_vector<int32_t>();
  const std::vector<int64_t> all(all32.begin(), all32.end());
  ExpertExchange x;
  x.plan_ = dist::ExpertParallelPlan::from_offsets(n, me, E, all, device);
  auto offset = [&](int p, int64_t e) { return all[static_cast<size_t>(p * (E + 1) + e)]; };
  const int64_t R = x.plan_.dispatched_rows();
  // A rank-local refusal from here on leaves the other ranks in the next collective (as a bad row count does with
  // the plan): the in-process backend aborts them, NCCL's watchdog times out. Stage 1 makes consistent inputs.
  MT_CHECK(row_choice.size(0) == R,
           "expert exchange: row_choice must have one entry per dispatched row, group_offsets[E] = {}; found {}", R,
           row_choice.describe());
  const std::vector<int32_t> choice = row_choice.to_vector<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    MT_CHECK(choice[static_cast<size_t>(r)] >= 0, "expert exchange: row_choice[{}] = {} is negative", r,
             choice[static_cast<size_t>(r)]);
  }

  // Send side: per destination q (its experts' rows are [begin, end)), the unique tokens in ascending order; each is
  // sent as the first of its rows, and every row learns its token's position in q's list.
  std::vector<int32_t> position(static_cast<size_t>(R));
  std::vector<int32_t> send_index;
  x.unique_send_rows_.assign(static_cast<size_t>(n), 0);
  std::vector<std::pair<int64_t, int64_t>> token_rows;  // (token, row), sorted
  for (int q = 0; q < n; ++q) {
    const int64_t begin = offset(me, q * El), end = offset(me, (q + 1) * El);
    token_rows.clear();
    for (int64_t r = begin; r < end; ++r) token_rows.emplace_back(choice[static_cast<size_t>(r)] / top_k, r);
    std::sort(token_rows.begin(), token_rows.end());
    int64_t unique = 0;
    for (size_t i = 0; i < token_rows.size(); ++i) {
      if (i == 0 || token_rows[i].first != token_rows[i - 1].first) {
        send_index.push_back(to_i32(token_rows[i].second));
        ++unique;
      }
      position[static_cast<size_t>(token_rows[i].second)] = to_i32(unique - 1);
    }
    x.unique_send_rows_[static_cast<size_t>(q)] = unique;
  }
  x.unique_send_total_ = static_cast<int64_t>(send_index.size());

  // Backward scatter: returned unique row j lands on dispatched row send_index[j]; every other row gets 0.
  std::vector<int32_t> returned_of_row(static_cast<size_t>(R), -1);
  for (size_t j = 0; j < send_index.size(); ++j) returned_of_row[static_cast<size_t>(send_index[j])] = to_i32(j);
  std::vector<int32_t> scatter_offsets{0}, scatter_rows;
  for (int64_t r = 0; r < R; ++r) {
    const int32_t j = returned_of_row[static_cast<size_t>(r)];
    if (j >= 0) scatter_rows.push_back(j);
    scatter_offsets.push_back(to_i32(static_cast<int64_t>(scatter_rows.size())));
  }

  // Host read 2: the positions, moved by the plan's dispatch into the local row layout.
  Tensor position_host = Tensor::from_vector(position, {R, 1});
  const Tensor local_position =
      x.plan_.dispatch(ep, stream, device.is_cpu() ? position_host : position_host.to(device));
  const std::vector<int32_t> received = local_position.to_vector<int32_t>();

  // Receive side: the local rows of expert e are source 0's rows of e, then source 1's, ... (the plan's layout).
  const int64_t L = x.plan_.local_rows();
  std::vector<int32_t> source(static_cast<size_t>(L));
  {
    int64_t l = 0;
    for (int64_t e = me * El; e < (me + 1) * El; ++e) {
      for (int p = 0; p < n; ++p) {
        for (int64_t i = offset(p, e); i < offset(p, e + 1); ++i) source[static_cast<size_t>(l++)] = p;
      }
    }
    MT_CHECK(l == L, "expert exchange: internal: {} local rows by the offsets but the plan has {}", l, L);
  }
  x.unique_recv_rows_.assign(static_cast<size_t>(n), 0);
  for (int64_t l = 0; l < L; ++l) {
    const int32_t pos = received[static_cast<size_t>(l)];
    MT_CHECK(pos >= 0 && pos < std::numeric_limits<int32_t>::max(),
             "expert exchange: ep rank {} received position {} for local row {}", me, pos, l);
    int64_t& count = x.unique_recv_rows_[static_cast<size_t>(source[static_cast<size_t>(l)])];
    count = std::max<int64_t>(count, pos + 1);
  }
  std::vector<int64_t> base(static_cast<size_t>(n) + 1, 0);
  for (int p = 0; p < n; ++p) base[p + 1] = base[p] + x.unique_recv_rows_[static_cast<size_t>(p)];
  x.unique_recv_total_ = base[static_cast<size_t>(n)];
  std::vector<int32_t> expand(static_cast<size_t>(L));
  std::vector<int32_t> copies(static_cast<size_t>(x.unique_recv_total_) + 1, 0);  // CSR offsets by counting
  for (int64_t l = 0; l < L; ++l) {
    const int64_t u = base[static_cast<size_t>(source[static_cast<size_t>(l)])] + received[static_cast<size_t>(l)];
    expand[static_cast<size_t>(l)] = to_i32(u);
    ++copies[static_cast<size_t>(u) + 1];
  }
  for (int64_t u = 0; u < x.unique_recv_total_; ++u) {
    // Each source's positions are 0 .. U - 1 without gaps (every unique token it sends has a row here).
    MT_CHECK(copies[static_cast<size_t>(u) + 1] > 0,
             "expert exchange: ep rank {} received no row for unique row {} (the positions have a gap)", me, u);
    copies[static_cast<size_t>(u) + 1] += copies[static_cast<size_t>(u)];
  }
  std::vector<int32_t> copy_rows(static_cast<size_t>(L));
  {
    std::vector<int32_t> next(copies.begin(), copies.end() - 1);
    for (int64_t l = 0; l < L; ++l) copy_rows[static_cast<size_t>(next[static_cast<size_t>(expand[l])]++)] = to_i32(l);
  }

  x.send_index_ = index_tensor(send_index, device);
  x.expand_index_ = index_tensor(expand, device);
  x.gather_offsets_ = index_tensor(copies, device);
  x.gather_rows_ = index_tensor(copy_rows, device);
  x.scatter_offsets_ = index_tensor(scatter_offsets, device);
  x.scatter_rows_ = index_tensor(scatter_rows, device);
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
  if (!deduplicate_) return plan_.dispatch_backward(ep, stream, d_local);
  const int64_t H = d_local.size(1);
  Tensor summed = Tensor::empty({unique_recv_total_, H}, d_local.dtype(), d_local.device());
  ops::sum_rows(stream, summed, d_local, gather_offsets_, gather_rows_);
  Tensor returned = Tensor::empty({unique_send_total_, H}, d_local.dtype(), d_local.device());
  ep.all_to_all_v(stream, returned, unique_send_rows_, summed, unique_recv_rows_);
  Tensor out = Tensor::empty({dispatched_rows(), H}, d_local.dtype(), d_local.device());
  ops::sum_rows(stream, out, returned, scatter_offsets_, scatter_rows_);
  return out;
}

}  // namespace moetrain::pipeline
