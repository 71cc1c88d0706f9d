// defines: the in-process Communicator backend: ranks are threads of one process sharing a
// LocalWorld (CPU tests and the CPU demo), and run_local_ranks, which runs a function on N thread
// ranks. Collectives match by call order (one sequence number per communicator); every reduction
// sums in rank order 0, 1, ..., n-1 whatever the arrival order, so results are bitwise
// reproducible. Fails closed: a rank that throws aborts the world, every blocking wait has a
// watchdog timeout, and ranks that call different ops at the same call number are named.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace moetrain::dist {

struct LocalWorldOptions {
  // How long any rank waits in a collective or recv before failing with the ranks that did not
  // arrive. Tests use about a second.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Where the ranks' tensors live: the CPU, or one CUDA device all the ranks share (run_local_ranks then hands them
  // host-staged communicators and lets one rank at a time run, dist/host_staged_communicator.h).
  Device device = Device::cpu();
};

// Shared state of N thread ranks. Create once, hand each thread its communicator.
//
// Error messages name ranks by their rank in the communicator the op ran on, with the world rank
// in parentheses for sub-communicators ("rank 1 (world 3)"); the failed rank of an abort is a
// world rank.
class LocalWorld {
 public:
  static std::shared_ptr<LocalWorld> create(int size, const LocalWorldOptions& options = {});
  ~LocalWorld();

  int size() const;
  // The world communicator ("world") of `rank`; each rank's is handed out once.
  std::unique_ptr<Communicator> communicator(int rank);
  // Marks world rank `rank` failed: every rank blocked in, or later entering, an op of this world
  // (or of any communicator split from it) gets an Error naming `rank` and `message`.
  void abort(int rank, const std::string& message);
  // Marks world rank `rank` done: a rank waiting for it fails at once instead of at the timeout.
  void finish(int rank);

  struct State;

 private:
  explicit LocalWorld(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
  std::shared_ptr<void> world_group_;  // the group behind the "world" communicators (.cpp)
};

// True when `comm` belongs to a LocalWorld (its ranks are threads of this process).
bool is_local_communicator(const Communicator& comm);

// Starts `size` threads, each calling fn(its world communicator), and joins them all (on a GPU, each thread holds the
// device's turn while fn runs, except while it waits in a communicator op). The first
// failure (in time) is rethrown on the caller's thread after every thread joined; a failing rank
// aborts the world so the others stop waiting on it.
void run_local_ranks(int size, const std::function<void(Communicator&)>& fn, const LocalWorldOptions& options = {});

}  // namespace moetrain::dist
