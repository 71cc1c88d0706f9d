// defines: per-op timing for `moetrain bench`, by op family and by op. When profiling is on, every public op
// function opens an OpScope naming its family and itself: on CUDA a pair of events on the op's stream (no
// synchronisation until the caller collects), on the CPU the wall clock. Only the outermost scope of a thread counts,
// so an op built from other ops (linear on gemm) is charged once, to its own family and name. Off by default: then a
// scope is one branch.
#pragma once

#include <map>
#include <string>

#include "core/device.h"

namespace moetrain::ops {

void set_op_profiling(bool on);
bool op_profiling();

class OpScope {
 public:
  // `family` and `op` are string literals (kept by pointer); no op name charges the family alone.
  OpScope(const Stream& stream, const char* family, const char* op = nullptr);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  bool nested_ = false;             // this scope entered the thread's depth count
  const Stream* stream_ = nullptr;  // set for the outermost scope only
  const char* family_ = nullptr;
  const char* op_ = nullptr;
  void* start_ = nullptr;  // a CUDA event, or a heap copy of the start time on the CPU
};

struct OpTimes {
  std::map<std::string, double> by_family;                     // seconds per family
  std::map<std::string, std::map<std::string, double>> by_op;  // seconds per op, under its family
};
// The seconds recorded since the last call (waits for the recorded events), then starts afresh.
OpTimes collect_op_times();

}  // namespace moetrain::ops
