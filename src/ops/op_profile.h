// defines: per-op-family timing for `moetrain bench`. When profiling is on, every public op
// function opens an OpScope: on CUDA a pair of events on the op's stream (no synchronisation
// until the caller collects), on the CPU the wall clock. Only the outermost scope of a thread
// counts, so an op built from other ops (linear on gemm) is charged once, to its own family.
// Off by default: then a scope is one branch.
#pragma once

#include <map>
#include <string>

#include "core/device.h"

namespace moetrain::ops {

void set_op_profiling(bool on);
bool op_profiling();

class OpScope {
 public:
  OpScope(const Stream& stream, const char* family);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  bool nested_ = false;             // this scope entered the thread's depth count
  const Stream* stream_ = nullptr;  // set for the outermost scope only
  const char* family_ = nullptr;
  void* start_ = nullptr;  // a CUDA event, or a heap copy of the start time on the CPU
};

// Seconds per family since the last call (waits for the recorded events), then starts afresh.
std::map<std::string, double> collect_op_times();

}  // namespace moetrain::ops
