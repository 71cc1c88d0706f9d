// defines: the TCP rendezvous that hands rank 0's blob (the 128-byte ncclUniqueId) to every rank
// before NCCL exists: rank 0 listens, every other rank connects, says who it is, and once all
// world_size - 1 ranks have checked in, rank 0 replies with the blob to each (so it is also a
// barrier). POSIX sockets, IPv4. The launcher's MASTER_ADDR / MASTER_PORT + 1 is the address
// (LaunchEnv::rendezvous_port); when NCCL_COMM_ID is set NCCL bootstraps itself and this is skipped.
//
// Wire format (big-endian u32s): hello = magic 'MTRZ', version, rank, world_size; reply = status
// (0 ok, 1 error), length, then `length` bytes: the blob, or an error message the client throws.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace moetrain::dist {

struct RendezvousOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};              // the whole exchange, per rank
  std::chrono::milliseconds retry_interval{std::chrono::milliseconds(100)};  // between connect attempts
};

// Rank 0's side. Binds on all interfaces at `port` (0: an ephemeral port, see port()) at once,
// so clients that start earlier are refused and retry until it listens.
class RendezvousServer {
 public:
  explicit RendezvousServer(int port);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  int port() const { return port_; }
  // Waits for ranks 1..world_size-1 to check in (duplicate ranks, ranks out of range and a
  // different world size are errors, reported to that client too), then sends `blob` to each.
  // On timeout, the error lists the ranks that never checked in.
  void serve(int world_size, const std::vector<uint8_t>& blob, const RendezvousOptions& options = {});

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A non-zero rank's side: connects to host:port (retrying refused connections until the
// deadline), checks in, and returns rank 0's blob.
std::vector<uint8_t> rendezvous_fetch(const std::string& host, int port, int rank, int world_size,
                                      const RendezvousOptions& options = {});

// Both sides in one call: rank 0 serves `blob` on `port`, other ranks fetch it from host:port.
// Returns the blob on every rank; world_size 1 returns `blob` without touching the network.
std::vector<uint8_t> rendezvous(const std::string& host, int port, int rank, int world_size,
                                const std::vector<uint8_t>& blob, const RendezvousOptions& options = {});

}  // namespace moetrain::dist
