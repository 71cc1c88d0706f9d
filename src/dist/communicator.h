// defines: Communicator, the one interface every collective and point-to-point transfer goes
// through (docs/design.md section 4), with two backends: NCCL (one process per GPU) and in-process
// (ranks are threads; CPU tests and the CPU demo). Also the argument checks both backends share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::dist {

enum class ReduceOp { Sum, Max };

std::string_view reduce_op_name(ReduceOp op);  // "sum", "max"

class Communicator {
 public:
  virtual ~Communicator();

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // "world", "dp", "ep", "pp", ... for errors

  // Every op runs on `stream` (CPU: synchronously; NCCL: enqueued). Tensors contiguous, same dtype,
  // on the communicator's device. Element counts and dtypes are validated (clear errors).
  virtual void all_reduce(Stream& stream, Tensor data, ReduceOp op) = 0;                       // in place
  virtual void all_gather(Stream& stream, Tensor out, const Tensor& in) = 0;                   // out = size x in
  virtual void reduce_scatter(Stream& stream, Tensor out, const Tensor& in, ReduceOp op) = 0;  // in = size x out
  virtual void broadcast(Stream& stream, Tensor data, int root) = 0;
  virtual void send(Stream& stream, const Tensor& data, int peer) = 0;
  virtual void recv(Stream& stream, Tensor data, int peer) = 0;
  // Rows along dim 0: sends send_rows[p] consecutive rows of `in` to rank p (rank order), receives
  // recv_rows[p] rows from p into `out` (rank order). Row counts are known on the host.
  virtual void all_to_all_v(Stream& stream, Tensor out, const std::vector<int64_t>& recv_rows, const Tensor& in,
                            const std::vector<int64_t>& send_rows) = 0;
  virtual void barrier(Stream& stream) = 0;
  // Groups send/recv (NCCL group semantics) so that paired exchanges cannot deadlock.
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  // Sub-communicator of the ranks with the same color, ordered by key then parent rank
  // (ncclCommSplit semantics). Every rank of this communicator calls it; a negative color returns
  // nullptr (the rank joins no group).
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  // Throws the error that broke this communicator (a watchdog timeout, an aborted peer), if any.
  // The trainer calls it once per step; every op also checks it on entry. Default: healthy.
  virtual void check_health() {}
};

// Argument checks shared by the backends (each names the op, the communicator and the rank).
namespace detail {
struct OpContext {
  std::string_view op;  // "all_reduce", ...
  const Communicator& comm;
};
void check_tensor(const OpContext& ctx, const Tensor& t, std::string_view what, Device device);
void check_same_dtype(const OpContext& ctx, const Tensor& a, std::string_view a_name, const Tensor& b,
                      std::string_view b_name);
void check_reducible(const OpContext& ctx, const Tensor& t);  // f32, f64, bf16, i32, i64
void check_peer(const OpContext& ctx, int peer, std::string_view what);
// Validates all_to_all_v's row counts against `in`/`out` and returns the elements per row.
int64_t check_all_to_all_v(const OpContext& ctx, const Tensor& out, const std::vector<int64_t>& recv_rows,
                           const Tensor& in, const std::vector<int64_t>& send_rows);
}  // namespace detail

}  // namespace moetrain::dist
