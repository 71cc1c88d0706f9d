// defines: the in-process backend: LocalWorld's shared state (one mutex and condition variable for
// the whole world, so an abort wakes every waiter of every sub-communicator), the per-call
// rendezvous slots collectives meet in, mailboxes for send/recv, and run_local_ranks.
//
// Protocol of a collective: each rank arrives at the slot of its next call number, checks that
// the op matches the first arrival's, copies its contribution into the slot (so the caller may
// reuse its buffers as soon as the op returns) and waits until every member arrived. Then each
// rank computes its own output from the staged contributions, in rank order, outside the lock.
// The last arrival removes the slot from the table; the ranks hold it alive until they are done.
#include "dist/inprocess_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "dist/host_staged_communicator.h"
#include "dist/local_reduce.h"

namespace moetrain::dist {

using Clock = std::chrono::steady_clock;

struct LocalWorld::State {
  int size = 0;
  std::chrono::milliseconds timeout{};
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  int failed_rank = -1;
  std::string failed_message;
  std::vector<bool> finished;
  std::vector<bool> handed_out;
};

namespace {

using WorldState = LocalWorld::State;
using Bytes = std::unique_ptr<std::byte[]>;

Bytes copy_bytes_of(const void* data, size_t n) {
  Bytes b(new std::byte[n == 0 ? 1 : n]);
  if (n > 0) std::memcpy(b.get(), data, n);
  return b;
}

std::string seconds_str(std::chrono::milliseconds d) { return fmt::format("{:g} s", d.count() / 1000.0); }

// What a rank called at one call number; two ranks must agree on all of it.
struct OpDesc {
  std::string op;      // "all_reduce", ...
  std::string detail;  // "sum of 6 x f32", ...
  bool operator==(const OpDesc&) const = default;
  std::string str() const { return detail.empty() ? op : fmt::format("{} ({})", op, detail); }
};

struct Group;

struct Slot {
  OpDesc desc;
  int first_rank = 0;
  int arrived = 0;
  std::vector<bool> present;
  std::vector<Bytes> staged;  // one contribution per group rank (empty where the op has none)
  std::vector<std::vector<int64_t>> send_rows, recv_rows;  // all_to_all_v
  std::vector<int> colors, keys;                           // split
  std::map<int, std::shared_ptr<Group>> split_groups;      // split: filled by the last arrival
  std::string error;                                       // set on a mismatch; every member throws it
};

struct Message {
  DType dtype;
  int64_t numel;
  Bytes bytes;
};

// The shared state of one communicator (the world or a split of it).
struct Group {
  std::shared_ptr<WorldState> world;
  std::vector<int> members;  // world rank of each group rank
  std::map<int64_t, std::shared_ptr<Slot>> slots;
  std::vector<std::deque<Message>> mailboxes;  // [src * n + dst]

  int size() const { return static_cast<int>(members.size()); }
};

std::shared_ptr<Group> make_group(std::shared_ptr<WorldState> world, std::vector<int> members) {
  auto g = std::make_shared<Group>();
  g->world = std::move(world);
  g->members = std::move(members);
  g->mailboxes.resize(static_cast<size_t>(g->size()) * g->size());
  return g;
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Group> group, int rank, std::string name)
      : group_(std::move(group)), rank_(rank), name_(std::move(name)) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  const std::string& name() const override { return name_; }

  void all_reduce(Stream& stream, Tensor data, ReduceOp op) override {
    const detail::OpContext ctx{"all_reduce", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, data, "data", Device::cpu());
    detail::check_reducible(ctx, data);
    const OpDesc desc{"all_reduce",
                      fmt::format("{} of {} x {}", reduce_op_name(op), data.numel(), dtype_name(data.dtype()))};
    auto slot = meet(desc, [&](Slot& s) { s.staged[rank_] = copy_bytes_of(data.raw_data(), data.nbytes()); });
    detail::reduce_in_rank_order(data.dtype(), op, data.raw_data(), parts(*slot, 0), data.numel());
  }

  void all_gather(Stream& stream, Tensor out, const Tensor& in) override {
    const detail::OpContext ctx{"all_gather", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, out, "out", Device::cpu());
    detail::check_tensor(ctx, in, "in", Device::cpu());
    detail::check_same_dtype(ctx, out, "out", in, "in");
    MT_CHECK(out.numel() == in.numel() * size(),
             "dist: all_gather on '{}' (rank {}): out must hold size ({}) x in ({}) = {} elements; found {}", name_,
             rank_, size(), in.describe(), in.numel() * size(), out.describe());
    const OpDesc desc{"all_gather", fmt::format("{} x {} per rank", in.numel(), dtype_name(in.dtype()))};
    auto slot = meet(desc, [&](Slot& s) { s.staged[rank_] = copy_bytes_of(in.raw_data(), in.nbytes()); });
    auto* o = static_cast<std::byte*>(out.raw_data());
    if (in.nbytes() == 0) return;
    for (int r = 0; r < size(); ++r) std::memcpy(o + r * in.nbytes(), slot->staged[r].get(), in.nbytes());
  }

  void reduce_scatter(Stream& stream, Tensor out, const Tensor& in, ReduceOp op) override {
    const detail::OpContext ctx{"reduce_scatter", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, out, "out", Device::cpu());
    detail::check_tensor(ctx, in, "in", Device::cpu());
    detail::check_same_dtype(ctx, out, "out", in, "in");
    detail::check_reducible(ctx, in);
    MT_CHECK(in.numel() == out.numel() * size(),
             "dist: reduce_scatter on '{}' (rank {}): in must hold size ({}) x out ({}) = {} elements; found {}", name_,
             rank_, size(), out.describe(), out.numel() * size(), in.describe());
    const OpDesc desc{"reduce_scatter",
                      fmt::format("{} of {} x {} per rank", reduce_op_name(op), out.numel(), dtype_name(out.dtype()))};
    auto slot = meet(desc, [&](Slot& s) { s.staged[rank_] = copy_bytes_of(in.raw_data(), in.nbytes()); });
    detail::reduce_in_rank_order(out.dtype(), op, out.raw_data(), parts(*slot, rank_ * out.nbytes()), out.numel());
  }

  void broadcast(Stream& stream, Tensor data, int root) override {
    const detail::OpContext ctx{"broadcast", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, data, "data", Device::cpu());
    detail::check_peer(ctx, root, "root");
    const OpDesc desc{"broadcast", fmt::format("{} x {} from root {}", data.numel(), dtype_name(data.dtype()), root)};
    auto slot = meet(desc, [&](Slot& s) {
      if (rank_ == root) s.staged[rank_] = copy_bytes_of(data.raw_data(), data.nbytes());
    });
    if (rank_ != root && data.nbytes() > 0) std::memcpy(data.raw_data(), slot->staged[root].get(), data.nbytes());
  }

  void send(Stream& stream, const Tensor& data, int peer) override {
    const detail::OpContext ctx{"send", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, data, "data", Device::cpu());
    detail::check_peer(ctx, peer, "peer");
    WorldState& w = *group_->world;
    std::unique_lock lock(w.mu);
    throw_if_aborted("send");
    // Sends are buffered: the message is copied into the peer's mailbox and the call returns.
    group_->mailboxes[rank_ * size() + peer].push_back(
        Message{data.dtype(), data.numel(), copy_bytes_of(data.raw_data(), data.nbytes())});
    w.cv.notify_all();
  }

  void recv(Stream& stream, Tensor data, int peer) override {
    const detail::OpContext ctx{"recv", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, data, "data", Device::cpu());
    detail::check_peer(ctx, peer, "peer");
    if (group_depth_ > 0) {
      // Inside a group, receives wait until group_end, after every send of the group was posted.
      pending_recvs_.push_back({data, peer});
      return;
    }
    receive(data, peer);
  }

  void all_to_all_v(Stream& stream, Tensor out, const std::vector<int64_t>& recv_rows, const Tensor& in,
                    const std::vector<int64_t>& send_rows) override {
    const detail::OpContext ctx{"all_to_all_v", *this};
    check_stream(ctx, stream);
    detail::check_tensor(ctx, out, "out", Device::cpu());
    detail::check_tensor(ctx, in, "in", Device::cpu());
    const int64_t width = detail::check_all_to_all_v(ctx, out, recv_rows, in, send_rows);
    const OpDesc desc{"all_to_all_v", fmt::format("rows of {} x {}", width, dtype_name(in.dtype()))};
    auto slot = meet(desc, [&](Slot& s) {
      s.staged[rank_] = copy_bytes_of(in.raw_data(), in.nbytes());
      s.send_rows[rank_] = send_rows;
      s.recv_rows[rank_] = recv_rows;
    });
    // Every rank checks every pair, so all of them fail with the same message.
    for (int src = 0; src < size(); ++src) {
      for (int dst = 0; dst < size(); ++dst) {
        MT_CHECK(slot->send_rows[src][dst] == slot->recv_rows[dst][src],
                 "dist: all_to_all_v on '{}': {} sends {} rows to {} but {} expects {} rows from {}", name_,
                 rank_label(src), slot->send_rows[src][dst], rank_label(dst), rank_label(dst),
                 slot->recv_rows[dst][src], rank_label(src));
      }
    }
    const size_t row_bytes = static_cast<size_t>(width) * dtype_size(in.dtype());
    auto* o = static_cast<std::byte*>(out.raw_data());
    for (int src = 0; src < size(); ++src) {
      int64_t src_offset = 0;  // rows rank src sends to ranks before this one
      for (int d = 0; d < rank_; ++d) src_offset += slot->send_rows[src][d];
      const size_t n = static_cast<size_t>(recv_rows[src]) * row_bytes;
      if (n > 0) std::memcpy(o, slot->staged[src].get() + src_offset * row_bytes, n);
      o += n;
    }
  }

  void barrier(Stream& stream) override {
    check_stream({"barrier", *this}, stream);
    meet({"barrier", ""}, [](Slot&) {});
  }

  void group_start() override { ++group_depth_; }

  void group_end() override {
    MT_CHECK(group_depth_ > 0, "dist: group_end on '{}' (rank {}) without a matching group_start", name_, rank_);
    if (--group_depth_ > 0) return;
    std::vector<PendingRecv> pending = std::move(pending_recvs_);
    pending_recvs_.clear();
    for (PendingRecv& p : pending) receive(p.data, p.peer);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    const OpDesc desc{"split", ""};
    auto slot = meet(
        desc,
        [&](Slot& s) {
          s.colors[rank_] = color;
          s.keys[rank_] = key;
        },
        [this](Slot& s) {
          // The last arrival builds one group per color: members ordered by (key, parent rank).
          std::map<int, std::vector<int>> by_color;
          for (int r = 0; r < size(); ++r) {
            if (s.colors[r] >= 0) by_color[s.colors[r]].push_back(r);
          }
          for (auto& [c, ranks] : by_color) {
            std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return s.keys[a] < s.keys[b]; });
            std::vector<int> world_ranks;
            for (int r : ranks) world_ranks.push_back(group_->members[r]);
            s.split_groups[c] = make_group(group_->world, std::move(world_ranks));
          }
        });
    if (color < 0) return nullptr;
    std::shared_ptr<Group> g = slot->split_groups.at(color);
    const auto it = std::find(g->members.begin(), g->members.end(), group_->members[rank_]);
    return std::make_unique<InProcessCommunicator>(g, static_cast<int>(it - g->members.begin()), name);
  }

  void check_health() override {
    std::unique_lock lock(group_->world->mu);
    throw_if_aborted("check_health");
  }

 private:
  struct PendingRecv {
    Tensor data;
    int peer;
  };

  void check_stream(const detail::OpContext& ctx, const Stream& stream) const {
    MT_CHECK(stream.device().is_cpu(),
             "dist: {} on '{}' (rank {}): the in-process backend runs on the CPU stream; found a stream on {}", ctx.op,
             name_, rank_, stream.device().str());
  }

  // "rank 1" on the world, "rank 1 (world 3)" on a sub-communicator.
  std::string rank_label(int r) const {
    const int w = group_->members[r];
    return (group_->size() == group_->world->size && w == r) ? fmt::format("rank {}", r)
                                                             : fmt::format("rank {} (world {})", r, w);
  }

  std::string ranks_str(const std::vector<int>& ranks) const {
    std::string s;
    for (int r : ranks) s += (s.empty() ? "" : ", ") + rank_label(r);
    return s;
  }

  // Caller holds the world lock.
  void throw_if_aborted(std::string_view what) const {
    const WorldState& w = *group_->world;
    if (!w.aborted) return;
    throw Error(fmt::format("dist: rank {} failed ({}) while {} waited in {} on '{}'", w.failed_rank, w.failed_message,
                            rank_label(rank_), what, name_));
  }

  std::vector<const void*> parts(const Slot& s, size_t byte_offset) const {
    std::vector<const void*> p;
    for (int r = 0; r < size(); ++r) p.push_back(s.staged[r].get() + byte_offset);
    return p;
  }

  // Arrives at this communicator's next call number with `desc`; `stage` copies this rank's
  // contribution into the slot under the lock; `on_complete` runs once, under the lock, in the
  // last arrival. Returns the slot once every member arrived.
  template <typename Stage, typename Complete = void (*)(Slot&)>
  std::shared_ptr<Slot> meet(
      const OpDesc& desc, Stage&& stage, Complete&& on_complete = [](Slot&) {}) {
    WorldState& w = *group_->world;
    const int64_t seq = next_seq_++;
    const int n = size();
    std::unique_lock lock(w.mu);
    throw_if_aborted(desc.op);
    std::shared_ptr<Slot>& entry = group_->slots[seq];
    if (!entry) {
      entry = std::make_shared<Slot>();
      entry->desc = desc;
      entry->first_rank = rank_;
      entry->present.assign(n, false);
      entry->staged.resize(n);
      entry->send_rows.resize(n);
      entry->recv_rows.resize(n);
      entry->colors.assign(n, -1);
      entry->keys.assign(n, 0);
    }
    std::shared_ptr<Slot> slot = entry;
    if (!slot->error.empty()) throw Error(slot->error);
    if (!(slot->desc == desc)) {
      slot->error = fmt::format("dist: mismatched calls at call #{} on '{}': {} called {} but {} called {}", seq, name_,
                                rank_label(slot->first_rank), slot->desc.str(), rank_label(rank_), desc.str());
      w.cv.notify_all();
      throw Error(slot->error);
    }
    stage(*slot);
    slot->present[rank_] = true;
    if (++slot->arrived == n) {
      on_complete(*slot);
      group_->slots.erase(seq);
      w.cv.notify_all();
      return slot;
    }
    const auto deadline = Clock::now() + w.timeout;
    while (slot->arrived < n) {
      if (!slot->error.empty()) throw Error(slot->error);
      throw_if_aborted(desc.op);
      std::vector<int> missing, finished;
      for (int r = 0; r < n; ++r) {
        if (slot->present[r]) continue;
        missing.push_back(r);
        if (w.finished[group_->members[r]]) finished.push_back(r);
      }
      MT_CHECK(finished.empty(), "dist: {} finished without calling {} (call #{}) on '{}' that {} waited in",
               ranks_str(finished), desc.str(), seq, name_, rank_label(rank_));
      if (w.cv.wait_until(lock, deadline) == std::cv_status::timeout && slot->arrived < n) {
        MT_FAIL("dist: timeout after {} in {} (call #{}) on '{}' at {}: {} did not arrive", seconds_str(w.timeout),
                desc.str(), seq, name_, rank_label(rank_), ranks_str(missing));
      }
    }
    return slot;
  }

  void receive(Tensor data, int peer) {
    WorldState& w = *group_->world;
    std::deque<Message>& box = group_->mailboxes[peer * size() + rank_];
    std::unique_lock lock(w.mu);
    const auto deadline = Clock::now() + w.timeout;
    while (box.empty()) {
      throw_if_aborted(fmt::format("recv from rank {}", peer));
      MT_CHECK(!w.finished[group_->members[peer]],
               "dist: {} finished without sending to {} on '{}' that waited in recv", rank_label(peer),
               rank_label(rank_), name_);
      if (w.cv.wait_until(lock, deadline) == std::cv_status::timeout && box.empty()) {
        MT_FAIL("dist: timeout after {} in recv on '{}' at {}: {} did not send", seconds_str(w.timeout), name_,
                rank_label(rank_), rank_label(peer));
      }
    }
    Message m = std::move(box.front());
    box.pop_front();
    lock.unlock();
    MT_CHECK(m.dtype == data.dtype() && m.numel == data.numel(),
             "dist: recv on '{}': {} expects {} x {} from {} but it sent {} x {}", name_, rank_label(rank_),
             data.numel(), dtype_name(data.dtype()), rank_label(peer), m.numel, dtype_name(m.dtype));
    if (data.nbytes() > 0) std::memcpy(data.raw_data(), m.bytes.get(), data.nbytes());
  }

  std::shared_ptr<Group> group_;
  int rank_;
  std::string name_;
  int64_t next_seq_ = 0;
  int group_depth_ = 0;
  std::vector<PendingRecv> pending_recvs_;
};

}  // namespace

LocalWorld::LocalWorld(std::shared_ptr<State> state) : state_(std::move(state)) {
  std::vector<int> members(state_->size);
  for (int r = 0; r < state_->size; ++r) members[r] = r;
  world_group_ = make_group(state_, std::move(members));
}
LocalWorld::~LocalWorld() = default;

std::shared_ptr<LocalWorld> LocalWorld::create(int size, const LocalWorldOptions& options) {
  MT_CHECK(size >= 1, "dist: a local world needs at least one rank; found size {}", size);
  MT_CHECK(options.timeout.count() > 0, "dist: the local world's timeout must be positive; found {} ms",
           options.timeout.count());
  auto state = std::make_shared<State>();
  state->size = size;
  state->timeout = options.timeout;
  state->finished.assign(size, false);
  state->handed_out.assign(size, false);
  return std::shared_ptr<LocalWorld>(new LocalWorld(std::move(state)));
}

int LocalWorld::size() const { return state_->size; }

std::unique_ptr<Communicator> LocalWorld::communicator(int rank) {
  std::lock_guard lock(state_->mu);
  MT_CHECK(rank >= 0 && rank < state_->size, "dist: local world of {} ranks has no rank {}", state_->size, rank);
  MT_CHECK(!state_->handed_out[rank], "dist: the communicator of rank {} was already handed out", rank);
  state_->handed_out[rank] = true;
  return std::make_unique<InProcessCommunicator>(std::static_pointer_cast<Group>(world_group_), rank, "world");
}

void LocalWorld::abort(int rank, const std::string& message) {
  std::lock_guard lock(state_->mu);
  if (!state_->aborted) {
    state_->aborted = true;
    state_->failed_rank = rank;
    state_->failed_message = message;
  }
  state_->cv.notify_all();
}

void LocalWorld::finish(int rank) {
  std::lock_guard lock(state_->mu);
  MT_CHECK(rank >= 0 && rank < state_->size, "dist: local world of {} ranks has no rank {}", state_->size, rank);
  state_->finished[rank] = true;
  state_->cv.notify_all();
}

bool is_local_communicator(const Communicator& comm) {
  return dynamic_cast<const InProcessCommunicator*>(&comm) != nullptr || is_host_staged(comm);
}

void run_local_ranks(int size, const std::function<void(Communicator&)>& fn, const LocalWorldOptions& options) {
  std::shared_ptr<LocalWorld> world = LocalWorld::create(size, options);
  // Ranks on a GPU share it through host-staged communicators and take turns on it (dist/host_staged_communicator.h).
  const bool on_gpu = options.device.is_cuda();
  const auto turn = std::make_shared<DeviceTurn>();
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) {
    comms.push_back(on_gpu ? stage_through_host(world->communicator(r), options.device, turn) : world->communicator(r));
  }
  std::mutex first_mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::unique_lock<DeviceTurn> holds_turn(*turn, std::defer_lock);
        if (on_gpu) holds_turn.lock();
        fn(*comms[r]);
        if (on_gpu) holds_turn.unlock();
        world->finish(r);
      } catch (const std::exception& e) {
        {
          std::lock_guard lock(first_mu);
          if (!first) first = std::current_exception();
        }
        world->abort(r, e.what());
      } catch (...) {
        {
          std::lock_guard lock(first_mu);
          if (!first) first = std::current_exception();
        }
        world->abort(r, "unknown exception");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace moetrain::dist
