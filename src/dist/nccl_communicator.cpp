// defines: NcclCommunicator (an ncclComm_t plus its watchdog thread), the NCCL factories, and the
// CPU-only stand-ins that fail clearly. nccl.h and cuda_runtime.h are included here only.
//
// Concurrency: the op thread enqueues NCCL calls holding `op_mu_`; the watchdog takes `op_mu_`
// before ncclCommAbort, so an abort never frees the communicator under an enqueue. When the op
// thread is stuck inside a host-blocking NCCL call (a peer that never connects), the watchdog
// cannot get `op_mu_`; after one more timeout period it aborts anyway: ncclCommAbort is NCCL's
// documented way to unblock such a call, and the failure was logged first.
#include "dist/nccl_communicator.h"

#include "core/error.h"

#if MOETRAIN_HAS_CUDA

#include <cuda_runtime.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "core/log.h"

namespace moetrain::dist {

namespace {

using Clock = std::chrono::steady_clock;
static_assert(sizeof(ncclUniqueId) == sizeof(NcclId::bytes), "ncclUniqueId is NCCL_UNIQUE_ID_BYTES long");

#define MT_DIST_CUDA_CHECK(call)                                                                   \
  do {                                                                                             \
    const cudaError_t mt_err_ = (call);                                                            \
    MT_CHECK(mt_err_ == cudaSuccess, "dist: {} failed: {} ({})", #call, cudaGetErrorName(mt_err_), \
             cudaGetErrorString(mt_err_));                                                         \
  } while (0)

std::string seconds_str(std::chrono::milliseconds d) { return fmt::format("{:g} s", d.count() / 1000.0); }

ncclDataType_t nccl_reduce_type(DType d) {
  switch (d) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    default: MT_FAIL("dist: NCCL reductions support f32, f64, bf16, i32 and i64; found {}", dtype_name(d));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

cudaStream_t native(const Stream& s) { return static_cast<cudaStream_t>(s.native()); }

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, Device device, std::string name, const NcclOptions& options)
      : comm_(comm), device_(device), name_(std::move(name)), options_(options) {
    MT_CHECK(options.timeout.count() > 0 && options.poll_interval.count() > 0,
             "dist: NCCL timeout and poll interval must be positive; found {} ms and {} ms", options.timeout.count(),
             options.poll_interval.count());
    check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", "create");
    check(ncclCommCount(comm_, &size_), "ncclCommCount", "create");
    MT_DIST_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(int32_t)));
    MT_DIST_CUDA_CHECK(cudaMemset(barrier_buf_, 0, sizeof(int32_t)));
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard lock(health_mu_);
      stop_ = true;
    }
    health_cv_.notify_all();
    watchdog_.join();
    std::lock_guard op_lock(op_mu_);
    if (!aborted_) {
      // Local teardown; errors here have nowhere to go but the log.
      const ncclResult_t r = ncclCommDestroy(comm_);
      if (r != ncclSuccess) log_warn("dist: ncclCommDestroy on '{}' failed: {}", name_, ncclGetErrorString(r));
    }
    cudaFree(barrier_buf_);
    for (const Pending& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  void all_reduce(Stream& stream, Tensor data, ReduceOp op) override {
    const detail::OpContext ctx{"all_reduce", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, data, "data", device_);
    detail::check_reducible(ctx, data);
    enqueue(ctx, "ncclAllReduce", stream, [&] {
      return ncclAllReduce(data.raw_data(), data.raw_data(), static_cast<size_t>(data.numel()),
                           nccl_reduce_type(data.dtype()), nccl_op(op), comm_, native(stream));
    });
  }

  void all_gather(Stream& stream, Tensor out, const Tensor& in) override {
    const detail::OpContext ctx{"all_gather", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, out, "out", device_);
    detail::check_tensor(ctx, in, "in", device_);
    detail::check_same_dtype(ctx, out, "out", in, "in");
    MT_CHECK(out.numel() == in.numel() * size_,
             "dist: all_gather on '{}' (rank {}): out must hold size ({}) x in ({}) = {} elements; found {}", name_,
             rank_, size_, in.describe(), in.numel() * size_, out.describe());
    enqueue(ctx, "ncclAllGather", stream, [&] {
      return ncclAllGather(in.raw_data(), out.raw_data(), in.nbytes(), ncclUint8, comm_, native(stream));
    });
  }

  void reduce_scatter(Stream& stream, Tensor out, const Tensor& in, ReduceOp op) override {
    const detail::OpContext ctx{"reduce_scatter", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, out, "out", device_);
    detail::check_tensor(ctx, in, "in", device_);
    detail::check_same_dtype(ctx, out, "out", in, "in");
    detail::check_reducible(ctx, in);
    MT_CHECK(in.numel() == out.numel() * size_,
             "dist: reduce_scatter on '{}' (rank {}): in must hold size ({}) x out ({}) = {} elements; found {}", name_,
             rank_, size_, out.describe(), out.numel() * size_, in.describe());
    enqueue(ctx, "ncclReduceScatter", stream, [&] {
      return ncclReduceScatter(in.raw_data(), out.raw_data(), static_cast<size_t>(out.numel()),
                               nccl_reduce_type(out.dtype()), nccl_op(op), comm_, native(stream));
    });
  }

  void broadcast(Stream& stream, Tensor data, int root) override {
    const detail::OpContext ctx{"broadcast", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, data, "data", device_);
    detail::check_peer(ctx, root, "root");
    enqueue(ctx, "ncclBroadcast", stream, [&] {
      return ncclBroadcast(data.raw_data(), data.raw_data(), data.nbytes(), ncclUint8, root, comm_, native(stream));
    });
  }

  void send(Stream& stream, const Tensor& data, int peer) override {
    const detail::OpContext ctx{"send", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, data, "data", device_);
    detail::check_peer(ctx, peer, "peer");
    enqueue(ctx, "ncclSend", stream,
            [&] { return ncclSend(data.raw_data(), data.nbytes(), ncclUint8, peer, comm_, native(stream)); });
  }

  void recv(Stream& stream, Tensor data, int peer) override {
    const detail::OpContext ctx{"recv", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, data, "data", device_);
    detail::check_peer(ctx, peer, "peer");
    enqueue(ctx, "ncclRecv", stream,
            [&] { return ncclRecv(data.raw_data(), data.nbytes(), ncclUint8, peer, comm_, native(stream)); });
  }

  void all_to_all_v(Stream& stream, Tensor out, const std::vector<int64_t>& recv_rows, const Tensor& in,
                    const std::vector<int64_t>& send_rows) override {
    const detail::OpContext ctx{"all_to_all_v", *this};
    validate(ctx, stream);
    detail::check_tensor(ctx, out, "out", device_);
    detail::check_tensor(ctx, in, "in", device_);
    const int64_t width = detail::check_all_to_all_v(ctx, out, recv_rows, in, send_rows);
    const size_t row_bytes = static_cast<size_t>(width) * dtype_size(in.dtype());
    enqueue(ctx, "ncclSend/ncclRecv group", stream, [&] {
      // One NCCL group of paired sends and receives; zero-row pairs are skipped on both sides
      // (the counts agree, or the ranks disagree on the exchange and the peer hangs: the watchdog).
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      const auto* src = static_cast<const std::byte*>(in.raw_data());
      auto* dst = static_cast<std::byte*>(out.raw_data());
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        const size_t send_bytes = static_cast<size_t>(send_rows[p]) * row_bytes;
        const size_t recv_bytes = static_cast<size_t>(recv_rows[p]) * row_bytes;
        if (send_bytes > 0) r = ncclSend(src, send_bytes, ncclUint8, p, comm_, native(stream));
        if (r == ncclSuccess && recv_bytes > 0) r = ncclRecv(dst, recv_bytes, ncclUint8, p, comm_, native(stream));
        src += send_bytes;
        dst += recv_bytes;
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    });
  }

  void barrier(Stream& stream) override {
    const detail::OpContext ctx{"barrier", *this};
    validate(ctx, stream);
    enqueue(ctx, "ncclAllReduce (barrier)", stream,
            [&] { return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, comm_, native(stream)); });
  }

  void group_start() override {
    const detail::OpContext ctx{"group_start", *this};
    check_health();
    std::lock_guard lock(op_mu_);
    throw_if_failed(ctx);
    check(ncclGroupStart(), "ncclGroupStart", ctx.op);
    ++group_depth_;
  }

  void group_end() override {
    const detail::OpContext ctx{"group_end", *this};
    MT_CHECK(group_depth_ > 0, "dist: group_end on '{}' (rank {}) without a matching group_start", name_, rank_);
    std::lock_guard lock(op_mu_);
    throw_if_failed(ctx);
    --group_depth_;
    check(ncclGroupEnd(), "ncclGroupEnd", ctx.op);
    if (group_depth_ == 0) {
      // The grouped ops are launched now: one event per stream they used.
      for (cudaStream_t s : group_streams_) track(s, fmt::format("group of {}", group_ops_));
      group_streams_.clear();
      group_ops_.clear();
    }
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    const detail::OpContext ctx{"split", *this};
    MT_CHECK(group_depth_ == 0, "dist: split on '{}' (rank {}) inside a group_start/group_end", name_, rank_);
    std::lock_guard lock(op_mu_);
    throw_if_failed(ctx);
    ncclComm_t child = nullptr;
    check(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr), "ncclCommSplit", ctx.op);
    if (child == nullptr) return nullptr;
    return std::make_unique<NcclCommunicator>(child, device_, name, options_);
  }

  void check_health() override {
    std::lock_guard lock(health_mu_);
    if (!failure_.empty()) throw Error(failure_);
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::string op;
    Clock::time_point enqueued;
  };

  void check(ncclResult_t r, const char* call, std::string_view op) {
    if (r == ncclSuccess) return;
    const char* last = ncclGetLastError(comm_);
    MT_FAIL("dist: {} failed in {} on '{}' (rank {} of {}): {}{}{}", call, op, name_, rank_, size_,
            ncclGetErrorString(r), last && *last ? "; " : "", last ? last : "");
  }

  void validate(const detail::OpContext& ctx, const Stream& stream) {
    check_health();
    MT_CHECK(stream.device() == device_, "dist: {} on '{}' (rank {}): the stream is on {} but the communicator on {}",
             ctx.op, name_, rank_, stream.device().str(), device_.str());
  }

  // Caller holds op_mu_.
  void throw_if_failed(const detail::OpContext& ctx) {
    std::lock_guard lock(health_mu_);
    MT_CHECK(failure_.empty() && !aborted_, "{} (refusing {} on the aborted communicator)", failure_, ctx.op);
  }

  template <typename Call>
  void enqueue(const detail::OpContext& ctx, const char* nccl_call, Stream& stream, Call&& call) {
    std::lock_guard lock(op_mu_);
    throw_if_failed(ctx);
    const int64_t seq = next_seq_++;
    check(call(), nccl_call, ctx.op);
    const std::string what = fmt::format("{} (call #{})", ctx.op, seq);
    if (group_depth_ > 0) {
      // Inside a group nothing is launched until group_end; the event is recorded there.
      group_streams_.insert(native(stream));
      group_ops_ += (group_ops_.empty() ? "" : ", ") + what;
      return;
    }
    track(native(stream), what);
  }

  // Records an event after the op on `stream` for the watchdog. Caller holds op_mu_.
  void track(cudaStream_t stream, std::string what) {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard lock(health_mu_);
      if (!free_events_.empty()) {
        event = free_events_.back();
        free_events_.pop_back();
      }
    }
    if (event == nullptr) MT_DIST_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    MT_DIST_CUDA_CHECK(cudaEventRecord(event, stream));
    std::lock_guard lock(health_mu_);
    pending_.push_back({event, std::move(what), Clock::now()});
  }

  void watch() {
    cudaSetDevice(device_.index);
    std::unique_lock lock(health_mu_);
    std::optional<Clock::time_point> failed_at;
    while (!stop_) {
      health_cv_.wait_for(lock, options_.poll_interval, [this] { return stop_; });
      if (stop_ || aborted_) continue;
      if (failure_.empty()) {
        while (!pending_.empty()) {
          Pending& p = pending_.front();
          const cudaError_t q = cudaEventQuery(p.event);
          if (q == cudaSuccess) {
            free_events_.push_back(p.event);
            pending_.pop_front();
            continue;
          }
          if (q != cudaErrorNotReady) {
            fail_locked(fmt::format("dist: {} on '{}' (rank {} of {}) failed on the device: {}", p.op, name_, rank_,
                                    size_, cudaGetErrorString(q)));
          } else if (Clock::now() - p.enqueued > options_.timeout) {
            fail_locked(fmt::format(
                "dist: watchdog: {} on '{}' (rank {} of {}) did not complete within {} of being enqueued; a peer "
                "rank is missing, failed or called a different op; communicator aborted",
                p.op, name_, rank_, size_, seconds_str(options_.timeout)));
          }
          break;
        }
      }
      if (failure_.empty()) {
        ncclResult_t async = ncclSuccess;
        const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
        if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
          const char* last = ncclGetLastError(comm_);
          fail_locked(fmt::format("dist: NCCL reported an asynchronous error on '{}' (rank {} of {}): {}{}{}", name_,
                                  rank_, size_, ncclGetErrorString(r != ncclSuccess ? r : async),
                                  last && *last ? "; " : "", last ? last : ""));
        }
      }
      if (failure_.empty()) continue;
      if (!failed_at) failed_at = Clock::now();
      // Abort under op_mu_ unless the op thread has been stuck in NCCL for a further timeout.
      lock.unlock();
      std::unique_lock op_lock(op_mu_, std::try_to_lock);
      lock.lock();
      if (op_lock.owns_lock() || Clock::now() - *failed_at > options_.timeout) {
        lock.unlock();
        ncclCommAbort(comm_);
        lock.lock();
        aborted_ = true;
      }
    }
  }

  void fail_locked(std::string message) {
    failure_ = std::move(message);
    log_line(LogLevel::Error, failure_);
  }

  ncclComm_t comm_;
  Device device_;
  std::string name_;
  NcclOptions options_;
  int rank_ = 0;
  int size_ = 0;
  void* barrier_buf_ = nullptr;
  int64_t next_seq_ = 0;
  int group_depth_ = 0;
  std::set<cudaStream_t> group_streams_;
  std::string group_ops_;

  std::mutex op_mu_;  // held while enqueueing; the watchdog takes it to abort
  std::mutex health_mu_;
  std::condition_variable health_cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::string failure_;
  bool aborted_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

bool nccl_available() { return true; }

NcclId nccl_unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  MT_CHECK(r == ncclSuccess, "dist: ncclGetUniqueId failed: {}", ncclGetErrorString(r));
  NcclId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

std::unique_ptr<Communicator> create_nccl_communicator(const NcclId& id, int rank, int size, Device device,
                                                       const std::string& name, const NcclOptions& options) {
  MT_CHECK(device.is_cuda(), "dist: the NCCL communicator '{}' needs a CUDA device; found {}", name, device.str());
  MT_CHECK(size >= 1 && rank >= 0 && rank < size, "dist: NCCL communicator '{}': rank {} is outside world size {}",
           name, rank, size);
  MT_DIST_CUDA_CHECK(cudaSetDevice(device.index));
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, size, nid, rank);
  MT_CHECK(r == ncclSuccess, "dist: ncclCommInitRank for '{}' (rank {} of {} on {}) failed: {}{}{}", name, rank, size,
           device.str(), ncclGetErrorString(r), ncclGetLastError(nullptr) ? "; " : "",
           ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "");
  return std::make_unique<NcclCommunicator>(comm, device, name, options);
}

std::unique_ptr<Communicator> connect_nccl_world(const LaunchEnv& env, Device device, const NcclOptions& options,
                                                 const RendezvousOptions& rendezvous_options) {
  MT_CHECK(device.is_cuda(), "dist: the NCCL world needs a CUDA device; found {}", device.str());
  MT_DIST_CUDA_CHECK(cudaSetDevice(device.index));
  NcclId id;
  if (env.world_size == 1 || env.nccl_comm_id) {
    id = nccl_unique_id();  // with NCCL_COMM_ID every rank derives the same id from that address
  } else {
    std::vector<uint8_t> blob;
    if (env.rank == 0) {
      const NcclId mine = nccl_unique_id();
      blob.assign(mine.bytes.begin(), mine.bytes.end());
    }
    blob = rendezvous(env.master_addr, env.rendezvous_port(), env.rank, env.world_size, blob, rendezvous_options);
    MT_CHECK(blob.size() == id.bytes.size(), "dist: the rendezvous delivered {} bytes; an ncclUniqueId has {}",
             blob.size(), id.bytes.size());
    std::memcpy(id.bytes.data(), blob.data(), blob.size());
  }
  return create_nccl_communicator(id, env.rank, env.world_size, device, "world", options);
}

}  // namespace moetrain::dist

#else  // CPU-only build

namespace moetrain::dist {

namespace {
[[noreturn]] void no_nccl(const char* what) {
  MT_FAIL(
      "dist: {} needs the NCCL backend, but this build has no CUDA (configure with MOETRAIN_CUDA=ON on a machine "
      "with nvcc and NCCL); CPU runs use the in-process backend",
      what);
}
}  // namespace

bool nccl_available() { return false; }
NcclId nccl_unique_id() { no_nccl("nccl_unique_id"); }
std::unique_ptr<Communicator> create_nccl_communicator(const NcclId&, int, int, Device, const std::string&,
                                                       const NcclOptions&) {
  no_nccl("create_nccl_communicator");
}
std::unique_ptr<Communicator> connect_nccl_world(const LaunchEnv&, Device, const NcclOptions&,
                                                 const RendezvousOptions&) {
  no_nccl("connect_nccl_world");
}

}  // namespace moetrain::dist

#endif
