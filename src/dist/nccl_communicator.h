// defines: the NCCL Communicator backend (one process per GPU, production, multi-node) behind
// factory functions, so nccl.h and cuda_runtime.h stay inside nccl_communicator.cpp. A build
// without CUDA compiles the factories to clear errors.
//
// Every op is enqueued on the caller's stream (Stream::native() is the cudaStream_t) and followed
// by a CUDA event. A watchdog thread per communicator polls those events and
// ncclCommGetAsyncError; when an op has not completed `timeout` after it was enqueued, or NCCL
// reports an asynchronous error, it logs the failure, calls ncclCommAbort, and the next op on the
// communicator (or check_health(), which the trainer calls once per step) throws an Error naming
// the op, its call number, the communicator and the rank. After an abort the communicator is never
// touched again. Non-reducing ops (all_gather, broadcast, send/recv, all_to_all_v) move bytes, so
// they take every dtype; reductions take f32, f64, bf16, i32, i64 (NCCL's reduction order is its
// own: deterministic for a fixed topology and algorithm, but not rank order like the in-process
// backend).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "dist/bootstrap.h"
#include "dist/communicator.h"
#include "dist/rendezvous.h"

namespace moetrain::dist {

// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128).
struct NcclId {
  std::array<uint8_t, 128> bytes{};
};

struct NcclOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};             // per op, from enqueue to completion
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(100)};  // watchdog period
};

// True when this build has the NCCL backend (CUDA on).
bool nccl_available();

// ncclGetUniqueId: rank 0 calls it and hands the id to every rank (rendezvous). With NCCL_COMM_ID
// set, every rank may call it and gets the same id (NCCL then bootstraps at that address).
NcclId nccl_unique_id();

// Rank `rank` of an NCCL world of `size` processes on CUDA device `device` (this process's GPU:
// cudaSetDevice is called). Collective: every rank calls it with the same id.
std::unique_ptr<Communicator> create_nccl_communicator(const NcclId& id, int rank, int size, Device device,
                                                       const std::string& name = "world",
                                                       const NcclOptions& options = {});

// The world from the launcher's environment: the id comes from NCCL_COMM_ID when set (every rank
// asks NCCL), else rank 0 makes it and the TCP rendezvous on MASTER_ADDR:MASTER_PORT+1 hands it out.
std::unique_ptr<Communicator> connect_nccl_world(const LaunchEnv& env, Device device, const NcclOptions& options = {},
                                                 const RendezvousOptions& rendezvous_options = {});

}  // namespace moetrain::dist
