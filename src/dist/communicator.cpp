// defines: the Communicator's out-of-line pieces: the virtual destructor, ReduceOp names and the
// argument checks both backends run before they touch any data.
#include "dist/communicator.h"

#include <numeric>

#include "core/error.h"

namespace moetrain::dist {

Communicator::~Communicator() = default;

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

namespace detail {

namespace {
int64_t row_elements(const Tensor& t) {
  int64_t n = 1;
  for (int d = 1; d < t.dim(); ++d) n *= t.shape()[d];
  return n;
}
}  // namespace

void check_tensor(const OpContext& ctx, const Tensor& t, std::string_view what, Device device) {
  MT_CHECK(t.defined(), "dist: {} on '{}' (rank {}): {} is an undefined tensor", ctx.op, ctx.comm.name(),
           ctx.comm.rank(), what);
  MT_CHECK(t.is_contiguous(), "dist: {} on '{}' (rank {}): {} must be contiguous; found {}", ctx.op, ctx.comm.name(),
           ctx.comm.rank(), what, t.describe());
  MT_CHECK(t.device() == device, "dist: {} on '{}' (rank {}): {} must be on {} (the communicator's device); found {}",
           ctx.op, ctx.comm.name(), ctx.comm.rank(), what, device.str(), t.describe());
}

void check_same_dtype(const OpContext& ctx, const Tensor& a, std::string_view a_name, const Tensor& b,
                      std::string_view b_name) {
  MT_CHECK(a.dtype() == b.dtype(), "dist: {} on '{}' (rank {}): {} and {} must have the same dtype; found {} and {}",
           ctx.op, ctx.comm.name(), ctx.comm.rank(), a_name, b_name, a.describe(), b.describe());
}

void check_reducible(const OpContext& ctx, const Tensor& t) {
  const DType d = t.dtype();
  MT_CHECK(d == DType::F32 || d == DType::F64 || d == DType::BF16 || d == DType::I32 || d == DType::I64,
           "dist: {} on '{}' (rank {}): reductions support f32, f64, bf16, i32 and i64; found {}", ctx.op,
           ctx.comm.name(), ctx.comm.rank(), t.describe());
}

void check_peer(const OpContext& ctx, int peer, std::string_view what) {
  MT_CHECK(peer >= 0 && peer < ctx.comm.size(), "dist: {} on '{}' (rank {}): {} must be in [0, {}); found {}", ctx.op,
           ctx.comm.name(), ctx.comm.rank(), what, ctx.comm.size(), peer);
}

int64_t check_all_to_all_v(const OpContext& ctx, const Tensor& out, const std::vector<int64_t>& recv_rows,
                           const Tensor& in, const std::vector<int64_t>& send_rows) {
  const Communicator& c = ctx.comm;
  MT_CHECK(
      static_cast<int>(send_rows.size()) == c.size() && static_cast<int>(recv_rows.size()) == c.size(),
      "dist: all_to_all_v on '{}' (rank {}): send_rows and recv_rows need one entry per rank ({}); found {} and {}",
      c.name(), c.rank(), c.size(), send_rows.size(), recv_rows.size());
  MT_CHECK(in.dim() >= 1 && out.dim() >= 1,
           "dist: all_to_all_v on '{}' (rank {}): in and out need a row dimension; found {} and {}", c.name(), c.rank(),
           in.describe(), out.describe());
  check_same_dtype(ctx, out, "out", in, "in");
  for (int p = 0; p < c.size(); ++p) {
    MT_CHECK(
        send_rows[p] >= 0 && recv_rows[p] >= 0,
        "dist: all_to_all_v on '{}' (rank {}): row counts must be >= 0; found send_rows[{}] = {}, recv_rows[{}] = {}",
        c.name(), c.rank(), p, send_rows[p], p, recv_rows[p]);
  }
  const int64_t sent = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
  const int64_t received = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  MT_CHECK(sent == in.size(0), "dist: all_to_all_v on '{}' (rank {}): send_rows sum to {} but in has {} rows ({})",
           c.name(), c.rank(), sent, in.size(0), in.describe());
  MT_CHECK(received == out.size(0),
           "dist: all_to_all_v on '{}' (rank {}): recv_rows sum to {} but out has {} rows ({})", c.name(), c.rank(),
           received, out.size(0), out.describe());
  const int64_t width = row_elements(in);
  MT_CHECK(row_elements(out) == width,
           "dist: all_to_all_v on '{}' (rank {}): in and out rows must have the same element count; found {} ({}) and "
           "{} ({})",
           c.name(), c.rank(), width, in.describe(), row_elements(out), out.describe());
  return width;
}

}  // namespace detail
}  // namespace moetrain::dist
