// Tests for dist/rendezvous: rank 0 hands a 128-byte blob to every rank over TCP on 127.0.0.1
// (an ephemeral port), clients that start first retry, and the failures are named.
#include "dist/rendezvous.h"

#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace moetrain::dist {
namespace {

using namespace std::chrono_literals;

std::vector<uint8_t> sample_blob() {
  std::vector<uint8_t> blob(128);
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(i * 7 + 3);
  return blob;
}

TEST(Rendezvous, HandsRankZerosBlobToThreeRanks) {
  const std::vector<uint8_t> blob = sample_blob();
  RendezvousServer server(0);
  ASSERT_GT(server.port(), 0);
  std::vector<std::vector<uint8_t>> got(3);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (r == 0) {
          // The clients connect before serve() runs; the listening socket queues them.
          std::this_thread::sleep_for(50ms);
          server.serve(3, blob, {5s, 20ms});
          got[0] = blob;
        } else {
          got[r] = rendezvous_fetch("127.0.0.1", server.port(), r, 3, {5s, 20ms});
        }
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], blob) << "rank " << r;
  }
}

TEST(Rendezvous, ClientsRetryUntilRankZeroListens) {
  // Find a free port, release it, and start the server on it only after the clients began.
  int port = 0;
  { port = RendezvousServer(0).port(); }
  const std::vector<uint8_t> blob = sample_blob();
  std::vector<std::vector<uint8_t>> got(3);
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        if (r == 0) std::this_thread::sleep_for(200ms);
        got[r] = rendezvous("localhost", port, r, 3, r == 0 ? blob : std::vector<uint8_t>{}, {5s, 20ms});
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(got[r], blob) << "rank " << r;
  }
}

TEST(Rendezvous, ServerTimeoutNamesTheMissingRanks) {
  RendezvousServer server(0);
  std::string client_error;
  std::thread client([&] {
    try {
      rendezvous_fetch("127.0.0.1", server.port(), 2, 4, {5s, 20ms});
    } catch (const Error& e) {
      client_error = e.what();
    }
  });
  try {
    server.serve(4, sample_blob(), {500ms, 20ms});
    ADD_FAILURE() << "serve should time out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks [1, 3] never checked in (world size 4)"), std::string::npos)
        << e.what();
  }
  client.join();
  // The client that did check in is told why instead of waiting for its own timeout.
  EXPECT_NE(client_error.find("refused rank 2: rendezvous: timeout after 0.5 s"), std::string::npos) << client_error;
}

TEST(Rendezvous, ClientTimeoutWhenNobodyListens) {
  int port = 0;
  { port = RendezvousServer(0).port(); }
  const auto start = std::chrono::steady_clock::now();
  try {
    rendezvous_fetch("127.0.0.1", port, 1, 2, {300ms, 20ms});
    ADD_FAILURE() << "fetch should time out";
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(fmt::format("rank 1 could not reach rank 0 at 127.0.0.1:{} within 0.3 s", port)),
        std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST(Rendezvous, WorldSizeDisagreementIsReportedToBothSides) {
  RendezvousServer server(0);
  std::string client_error;
  std::thread client([&] {
    try {
      rendezvous_fetch("127.0.0.1", server.port(), 1, 3, {5s, 20ms});
    } catch (const Error& e) {
      client_error = e.what();
    }
  });
  try {
    server.serve(2, sample_blob(), {5s, 20ms});
    ADD_FAILURE() << "serve should refuse the client";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 has world size 3 but rank 0 has 2"), std::string::npos) << e.what();
  }
  client.join();
  EXPECT_NE(client_error.find("refused rank 1: rendezvous: rank 1 has world size 3 but rank 0 has 2"),
            std::string::npos)
      << client_error;
}

TEST(Rendezvous, UnresolvableHostIsAnError) {
  EXPECT_THROW(rendezvous_fetch("no-such-host.invalid", 29501, 1, 2, {300ms, 20ms}), Error);
}

TEST(Rendezvous, SingleRankWorldNeedsNoNetwork) {
  EXPECT_EQ(rendezvous("unused", 1, 0, 1, sample_blob()), sample_blob());
}

}  // namespace
}  // namespace moetrain::dist
