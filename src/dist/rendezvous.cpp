// defines: RendezvousServer, rendezvous_fetch and rendezvous over POSIX TCP sockets, every wait
// bounded by the caller's deadline (poll), connects retried while rank 0 is not yet listening.
#include "dist/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"

namespace moetrain::dist {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMagic = 0x4d54525a;  // "MTRZ"
constexpr uint32_t kVersion = 1;
constexpr uint32_t kStatusOk = 0;
constexpr uint32_t kStatusError = 1;
constexpr uint32_t kMaxPayload = 1u << 20;

std::string seconds_str(std::chrono::milliseconds d) { return fmt::format("{:g} s", d.count() / 1000.0); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

class Socket {
 public:
  explicit Socket(int fd = -1) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

// Waits for `events` on fd until the deadline; false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    MT_CHECK(errno == EINTR, "rendezvous: poll failed: {}", std::strerror(errno));
  }
}

// Reads exactly n bytes; `what` names the peer for errors.
void read_all(int fd, void* buf, size_t n, Clock::time_point deadline, const std::string& what) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    MT_CHECK(wait_for(fd, POLLIN, deadline), "rendezvous: timed out reading from {}", what);
    const ssize_t got = ::recv(fd, p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    MT_CHECK(got >= 0, "rendezvous: reading from {} failed: {}", what, std::strerror(errno));
    MT_CHECK(got > 0, "rendezvous: {} closed the connection early", what);
    p += got;
    n -= static_cast<size_t>(got);
  }
}

void write_all(int fd, const void* buf, size_t n, Clock::time_point deadline, const std::string& what) {
  const auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    MT_CHECK(wait_for(fd, POLLOUT, deadline), "rendezvous: timed out writing to {}", what);
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    MT_CHECK(put > 0, "rendezvous: writing to {} failed: {}", what, std::strerror(errno));
    p += put;
    n -= static_cast<size_t>(put);
  }
}

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  const uint32_t be = htonl(v);
  const auto* b = reinterpret_cast<const uint8_t*>(&be);
  out.insert(out.end(), b, b + 4);
}

uint32_t get_u32(const uint8_t* p) {
  uint32_t be;
  std::memcpy(&be, p, 4);
  return ntohl(be);
}

void send_reply(int fd, uint32_t status, const void* payload, size_t n, Clock::time_point deadline,
                const std::string& what) {
  std::vector<uint8_t> msg;
  put_u32(msg, status);
  put_u32(msg, static_cast<uint32_t>(n));
  const auto* p = static_cast<const uint8_t*>(payload);
  msg.insert(msg.end(), p, p + n);
  write_all(fd, msg.data(), msg.size(), deadline, what);
}

// Best effort: tells a client why the rendezvous failed before the server throws.
void send_error_quietly(int fd, const std::string& message) {
  try {
    send_reply(fd, kStatusError, message.data(), message.size(), Clock::now() + std::chrono::milliseconds(200),
               "a client");
  } catch (const Error&) {
  }
}

void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

}  // namespace

RendezvousServer::RendezvousServer(int port) {
  MT_CHECK(port >= 0 && port <= 65535, "rendezvous: port must be in [0, 65535]; found {}", port);
  fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  MT_CHECK(fd_ >= 0, "rendezvous: socket() failed: {}", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 1024) != 0) {
    const std::string reason = std::strerror(errno);
    ::close(fd_);
    MT_FAIL("rendezvous: rank 0 cannot listen on port {}: {} (another job on this port? pick another MASTER_PORT)",
            port, reason);
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
}

RendezvousServer::~RendezvousServer() {
  if (fd_ >= 0) ::close(fd_);
}

void RendezvousServer::serve(int world_size, const std::vector<uint8_t>& blob, const RendezvousOptions& options) {
  MT_CHECK(world_size >= 1, "rendezvous: world size must be at least 1; found {}", world_size);
  MT_CHECK(blob.size() <= kMaxPayload, "rendezvous: blob of {} bytes is larger than {}", blob.size(), kMaxPayload);
  const auto deadline = Clock::now() + options.timeout;
  std::map<int, Socket> clients;  // rank -> connection
  const auto fail = [&](const std::string& message) {
    for (auto& [r, s] : clients) send_error_quietly(s.fd(), message);
    throw Error(message);
  };
  while (static_cast<int>(clients.size()) < world_size - 1) {
    if (!wait_for(fd_, POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < world_size; ++r) {
        if (!clients.count(r)) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      fail(fmt::format("rendezvous: timeout after {} on port {}: ranks [{}] never checked in (world size {})",
                       seconds_str(options.timeout), port_, missing, world_size));
    }
    Socket conn(::accept(fd_, nullptr, nullptr));
    if (conn.fd() < 0) continue;  // the client went away between poll and accept
    uint8_t hello[16];
    try {
      read_all(conn.fd(), hello, sizeof(hello), deadline, "a connecting rank");
    } catch (const Error&) {
      continue;  // not one of ours, or it died: the timeout names the rank if it never comes back
    }
    if (get_u32(hello) != kMagic) continue;  // a stray connection (port scanner, health check)
    const uint32_t version = get_u32(hello + 4);
    const int rank = static_cast<int>(get_u32(hello + 8));
    const int their_world = static_cast<int>(get_u32(hello + 12));
    std::string problem;
    if (version != kVersion) {
      problem =
          fmt::format("rendezvous: rank {} speaks protocol version {} but rank 0 speaks {}", rank, version, kVersion);
    } else if (their_world != world_size) {
      problem = fmt::format("rendezvous: rank {} has world size {} but rank 0 has {}", rank, their_world, world_size);
    } else if (rank < 1 || rank >= world_size) {
      problem = fmt::format("rendezvous: a client checked in as rank {}, outside [1, {})", rank, world_size);
    } else if (clients.count(rank)) {
      problem = fmt::format("rendezvous: two processes checked in as rank {} (check RANK / SLURM_PROCID)", rank);
    }
    if (!problem.empty()) {
      send_error_quietly(conn.fd(), problem);
      fail(problem);
    }
    clients.emplace(rank, std::move(conn));
  }
  for (auto& [r, s] : clients) {
    send_reply(s.fd(), kStatusOk, blob.data(), blob.size(), deadline, fmt::format("rank {}", r));
  }
}

std::vector<uint8_t> rendezvous_fetch(const std::string& host, int port, int rank, int world_size,
                                      const RendezvousOptions& options) {
  MT_CHECK(world_size >= 2 && rank >= 1 && rank < world_size,
           "rendezvous: fetch is for ranks 1..world_size-1; found rank {} of world size {}", rank, world_size);
  MT_CHECK(port >= 1 && port <= 65535, "rendezvous: port must be in [1, 65535]; found {}", port);
  const auto deadline = Clock::now() + options.timeout;
  const std::string where = fmt::format("rank 0 at {}:{}", host, port);

  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  MT_CHECK(gai == 0 && found != nullptr, "rendezvous: rank {} cannot resolve MASTER_ADDR '{}': {}", rank, host,
           ::gai_strerror(gai));
  sockaddr_in target{};
  std::memcpy(&target, found->ai_addr, sizeof(target));
  ::freeaddrinfo(found);

  Socket sock;
  std::string last_error = "no attempt finished";
  for (;;) {
    Socket s(::socket(AF_INET, SOCK_STREAM, 0));
    MT_CHECK(s.fd() >= 0, "rendezvous: socket() failed: {}", std::strerror(errno));
    set_nonblocking(s.fd(), true);
    int rc = ::connect(s.fd(), reinterpret_cast<sockaddr*>(&target), sizeof(target));
    if (rc != 0 && errno == EINPROGRESS) {
      if (wait_for(s.fd(), POLLOUT, deadline)) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      set_nonblocking(s.fd(), false);
      sock = std::move(s);
      break;
    }
    last_error = std::strerror(errno);
    MT_CHECK(
        Clock::now() + options.retry_interval < deadline,
        "rendezvous: rank {} could not reach {} within {} (last error: {}); is rank 0 running and MASTER_ADDR right?",
        rank, where, seconds_str(options.timeout), last_error);
    std::this_thread::sleep_for(options.retry_interval);
  }
  const int one = 1;
  ::setsockopt(sock.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));

  std::vector<uint8_t> hello;
  put_u32(hello, kMagic);
  put_u32(hello, kVersion);
  put_u32(hello, static_cast<uint32_t>(rank));
  put_u32(hello, static_cast<uint32_t>(world_size));
  write_all(sock.fd(), hello.data(), hello.size(), deadline, where);

  uint8_t header[8];
  read_all(sock.fd(), header, sizeof(header), deadline, where);
  const uint32_t status = get_u32(header);
  const uint32_t length = get_u32(header + 4);
  MT_CHECK(length <= kMaxPayload, "rendezvous: {} announced a reply of {} bytes (limit {})", where, length,
           kMaxPayload);
  std::vector<uint8_t> payload(length);
  if (length > 0) read_all(sock.fd(), payload.data(), length, deadline, where);
  if (status != kStatusOk) {
    MT_FAIL("rendezvous: {} refused rank {}: {}", where, rank, std::string(payload.begin(), payload.end()));
  }
  return payload;
}

std::vector<uint8_t> rendezvous(const std::string& host, int port, int rank, int world_size,
                                const std::vector<uint8_t>& blob, const RendezvousOptions& options) {
  MT_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rendezvous: rank {} is outside world size {}", rank,
           world_size);
  if (world_size == 1) return blob;
  if (rank == 0) {
    RendezvousServer server(port);
    server.serve(world_size, blob, options);
    return blob;
  }
  return rendezvous_fetch(host, port, rank, world_size, options);
}

}  // namespace moetrain::dist
