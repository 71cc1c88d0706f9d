// defines: the communicator of thread ranks that share one GPU (dist.local_ranks with model.device = cuda): around
// each op of the in-process backend, a rank's device tensors are copied to host memory and the results copied back,
// so bytes move unchanged and reductions sum in rank order on the host, as on the CPU. The ranks take turns on the
// device: a rank holds the world's turn while it queues GPU work and lets go of it only while it waits in a
// communicator op, so the ranks' calls into the CUDA backend (its caches, its one stream per device) never interleave
// and every rank's work runs in its own program order.
#pragma once

#include <memory>
#include <mutex>

#include "core/device.h"
#include "dist/communicator.h"

namespace moetrain::dist {

// The turn the thread ranks of one device pass between them; the rank thread that runs holds it.
using DeviceTurn = std::mutex;

// Wraps `inner` (an in-process communicator): tensors live on `device` (a CUDA device; each op's stream is one of its
// streams); the calling rank holds `turn` on entry to every op and again on return.
std::unique_ptr<Communicator> stage_through_host(std::unique_ptr<Communicator> inner, Device device,
                                                 std::shared_ptr<DeviceTurn> turn);

// True when `comm` came from stage_through_host (its ranks are threads of this process).
bool is_host_staged(const Communicator& comm);

}  // namespace moetrain::dist
