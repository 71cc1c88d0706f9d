// defines: the op timers: a thread-local depth so nested ops count once, and a list of (family, op, start, stop)
// marks resolved when the bench collects them.
#include "ops/op_profile.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

#include "core/error.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/profile_events.h"
#endif

namespace moetrain::ops {

namespace {

using Clock = std::chrono::steady_clock;

struct Mark {
  const char* family = nullptr;
  const char* op = nullptr;
  bool cuda = false;
  void* start = nullptr;
  void* stop = nullptr;
  double cpu_seconds = 0.0;
};

std::atomic<bool> g_profiling{false};
std::mutex g_mutex;
std::vector<Mark> g_marks;
thread_local int t_depth = 0;

}  // namespace

void set_op_profiling(bool on) { g_profiling = on; }
bool op_profiling() { return g_profiling; }

OpScope::OpScope(const Stream& stream, const char* family, const char* op) {
  if (!g_profiling) return;
  nested_ = true;
  if (t_depth++ > 0) return;
  stream_ = &stream;
  family_ = family;
  op_ = op;
#if MOETRAIN_HAS_CUDA
  if (stream.device().is_cuda()) {
    start_ = cuda::record_profile_event(stream);
    return;
  }
#endif
  start_ = new Clock::time_point(Clock::now());
}

OpScope::~OpScope() {
  if (!nested_) return;
  --t_depth;
  if (stream_ == nullptr) return;
  Mark mark{family_, op_};
#if MOETRAIN_HAS_CUDA
  if (stream_->device().is_cuda()) {
    mark.cuda = true;
    mark.start = start_;
    mark.stop = cuda::record_profile_event(*stream_);
  }
#endif
  if (!mark.cuda) {
    auto* start = static_cast<Clock::time_point*>(start_);
    mark.cpu_seconds = std::chrono::duration<double>(Clock::now() - *start).count();
    delete start;
  }
  std::lock_guard lock(g_mutex);
  g_marks.push_back(std::move(mark));
}

OpTimes collect_op_times() {
  std::vector<Mark> marks;
  {
    std::lock_guard lock(g_mutex);
    marks.swap(g_marks);
  }
  OpTimes times;
  for (const Mark& mark : marks) {
    double seconds = mark.cpu_seconds;
#if MOETRAIN_HAS_CUDA
    if (mark.cuda) seconds = cuda::profile_event_seconds(mark.start, mark.stop);
#endif
    times.by_family[mark.family] += seconds;
    times.by_op[mark.family][mark.op != nullptr ? mark.op : mark.family] += seconds;
  }
  return times;
}

}  // namespace moetrain::ops
