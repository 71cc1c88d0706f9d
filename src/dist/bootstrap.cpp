// defines: read_launch_env (torchrun / Open MPI / Slurm / none) and the Slurm hostlist parser.
#include "dist/bootstrap.h"

#include <charconv>
#include <cstdlib>

#include "core/error.h"

namespace moetrain::dist {

namespace {

std::optional<std::string> lookup(const EnvLookup& env, const std::string& name) {
  std::optional<std::string> v = env(name);
  if (v && v->empty()) return std::nullopt;  // an empty variable counts as unset
  return v;
}

int parse_int(const std::string& name, const std::string& value) {
  int out = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, out);
  MT_CHECK(ec == std::errc() && ptr == end && out >= 0, "launch env: {} must be a non-negative integer; found '{}'",
           name, value);
  return out;
}

int require_int(const EnvLookup& env, const std::string& name, const std::string& launcher) {
  const std::optional<std::string> v = lookup(env, name);
  MT_CHECK(v.has_value(), "launch env ({}): {} is not set", launcher, name);
  return parse_int(name, *v);
}

std::optional<int> optional_int(const EnvLookup& env, const std::string& name) {
  const std::optional<std::string> v = lookup(env, name);
  if (!v) return std::nullopt;
  return parse_int(name, *v);
}

// SLURM_TASKS_PER_NODE: "2(x3),1" -> tasks on node `node` (2 on nodes 0-2, 1 on node 3).
int slurm_tasks_on_node(const std::string& spec, int node) {
  size_t pos = 0;
  int first_node = 0;
  while (pos < spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string::npos) comma = spec.size();
    const std::string item = spec.substr(pos, comma - pos);
    const size_t paren = item.find("(x");
    const int tasks = parse_int("SLURM_TASKS_PER_NODE", item.substr(0, paren));
    int repeat = 1;
    if (paren != std::string::npos) {
      MT_CHECK(item.back() == ')', "launch env: SLURM_TASKS_PER_NODE entry '{}' is malformed (expected N or N(xM))",
               item);
      repeat = parse_int("SLURM_TASKS_PER_NODE", item.substr(paren + 2, item.size() - paren - 3));
    }
    if (node < first_node + repeat) return tasks;
    first_node += repeat;
    pos = comma + 1;
  }
  MT_FAIL("launch env: SLURM_TASKS_PER_NODE '{}' describes {} nodes but SLURM_NODEID is {}", spec, first_node, node);
}

LaunchEnv read_torchrun(const EnvLookup& env) {
  LaunchEnv e;
  e.launcher = "torchrun";
  e.rank = require_int(env, "RANK", e.launcher);
  e.world_size = require_int(env, "WORLD_SIZE", e.launcher);
  e.local_rank = require_int(env, "LOCAL_RANK", e.launcher);
  e.local_world_size = require_int(env, "LOCAL_WORLD_SIZE", e.launcher);
  return e;
}

LaunchEnv read_mpi(const EnvLookup& env) {
  LaunchEnv e;
  e.launcher = "mpi";
  e.rank = require_int(env, "OMPI_COMM_WORLD_RANK", e.launcher);
  e.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", e.launcher);
  e.local_rank = require_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", e.launcher);
  e.local_world_size = require_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", e.launcher);
  return e;
}

LaunchEnv read_slurm(const EnvLookup& env) {
  LaunchEnv e;
  e.launcher = "slurm";
  e.rank = require_int(env, "SLURM_PROCID", e.launcher);
  const std::optional<int> ntasks = optional_int(env, "SLURM_NTASKS");
  e.world_size = ntasks ? *ntasks : require_int(env, "SLURM_NPROCS", e.launcher);
  e.local_rank = require_int(env, "SLURM_LOCALID", e.launcher);
  if (const std::optional<int> per_node = optional_int(env, "SLURM_NTASKS_PER_NODE")) {
    e.local_world_size = *per_node;
  } else if (const std::optional<std::string> spec = lookup(env, "SLURM_TASKS_PER_NODE")) {
    e.local_world_size = slurm_tasks_on_node(*spec, optional_int(env, "SLURM_NODEID").value_or(0));
  } else {
    std::optional<int> nodes = optional_int(env, "SLURM_JOB_NUM_NODES");
    if (!nodes) nodes = optional_int(env, "SLURM_NNODES");
    MT_CHECK(nodes.has_value() && *nodes > 0 && e.world_size % *nodes == 0,
             "launch env: Slurm gives no tasks per node (SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE) and SLURM_NTASKS "
             "({}) cannot be divided over SLURM_JOB_NUM_NODES ({})",
             e.world_size, nodes ? std::to_string(*nodes) : std::string("unset"));
    e.local_world_size = e.world_size / *nodes;
  }
  if (!lookup(env, "MASTER_ADDR")) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (const std::optional<std::string> list = lookup(env, name)) {
        e.master_addr = slurm_first_host(*list);
        break;
      }
    }
  }
  return e;
}

// A bracket group "[01-04,07]" -> its values as strings, zero padding kept.
std::vector<std::string> expand_range_list(const std::string& body, const std::string& nodelist) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= body.size()) {
    size_t comma = body.find(',', pos);
    if (comma == std::string::npos) comma = body.size();
    const std::string item = body.substr(pos, comma - pos);
    const size_t dash = item.find('-');
    const std::string lo_s = item.substr(0, dash);
    const std::string hi_s = dash == std::string::npos ? lo_s : item.substr(dash + 1);
    const auto digits = [](const std::string& s) {
      return !s.empty() && s.size() <= 9 && s.find_first_not_of("0123456789") == std::string::npos;
    };
    MT_CHECK(digits(lo_s) && digits(hi_s), "slurm nodelist '{}': range '{}' is not N or N-M", nodelist, item);
    const int lo = std::stoi(lo_s), hi = std::stoi(hi_s);
    MT_CHECK(lo <= hi, "slurm nodelist '{}': range '{}' runs backwards", nodelist, item);
    MT_CHECK(hi - lo < 1000000, "slurm nodelist '{}': range '{}' is too large", nodelist, item);
    for (int v = lo; v <= hi; ++v) out.push_back(fmt::format("{:0{}d}", v, lo_s.size()));
    pos = comma + 1;
  }
  return out;
}

// One host pattern ("rack[1-2]-gpu[01-02]") as literal pieces and bracket choices.
std::vector<std::vector<std::string>> parse_host_pattern(const std::string& pattern, const std::string& nodelist) {
  MT_CHECK(!pattern.empty(), "slurm nodelist '{}': empty host name", nodelist);
  std::vector<std::vector<std::string>> pieces;
  size_t pos = 0;
  while (pos < pattern.size()) {
    const size_t open = pattern.find('[', pos);
    const size_t close_before = pattern.find(']', pos);
    MT_CHECK(close_before == std::string::npos || (open != std::string::npos && close_before > open),
             "slurm nodelist '{}': ']' without '[' in '{}'", nodelist, pattern);
    if (open == std::string::npos) {
      pieces.push_back({pattern.substr(pos)});
      break;
    }
    if (open > pos) pieces.push_back({pattern.substr(pos, open - pos)});
    const size_t close = pattern.find(']', open);
    MT_CHECK(close != std::string::npos, "slurm nodelist '{}': '[' without ']' in '{}'", nodelist, pattern);
    const std::string body = pattern.substr(open + 1, close - open - 1);
    MT_CHECK(body.find('[') == std::string::npos, "slurm nodelist '{}': nested '[' in '{}'", nodelist, pattern);
    pieces.push_back(expand_range_list(body, nodelist));
    pos = close + 1;
  }
  return pieces;
}

// Splits on commas outside brackets.
std::vector<std::string> split_top_level(const std::string& nodelist) {
  std::vector<std::string> items;
  std::string current;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    MT_CHECK(depth >= 0 && depth <= 1, "slurm nodelist '{}': unbalanced brackets", nodelist);
    if (c == ',' && depth == 0) {
      items.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  MT_CHECK(depth == 0, "slurm nodelist '{}': '[' without ']'", nodelist);
  items.push_back(current);
  return items;
}

}  // namespace

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

LaunchEnv read_launch_env(const EnvLookup& env) {
  LaunchEnv e;
  if (lookup(env, "RANK")) {
    e = read_torchrun(env);
  } else if (lookup(env, "OMPI_COMM_WORLD_RANK")) {
    e = read_mpi(env);
  } else if (lookup(env, "SLURM_PROCID")) {
    e = read_slurm(env);
  }
  MT_CHECK(e.world_size >= 1, "launch env ({}): the world size must be at least 1; found {}", e.launcher, e.world_size);
  MT_CHECK(e.rank < e.world_size, "launch env ({}): rank {} is not below the world size {}", e.launcher, e.rank,
           e.world_size);
  MT_CHECK(e.local_world_size >= 1 && e.local_world_size <= e.world_size,
           "launch env ({}): the local world size must be in [1, world size {}]; found {}", e.launcher, e.world_size,
           e.local_world_size);
  MT_CHECK(e.local_rank < e.local_world_size, "launch env ({}): local rank {} is not below the local world size {}",
           e.launcher, e.local_rank, e.local_world_size);
  e.nccl_comm_id = lookup(env, "NCCL_COMM_ID").has_value();
  if (const std::optional<std::string> addr = lookup(env, "MASTER_ADDR")) e.master_addr = *addr;
  if (const std::optional<std::string> port = lookup(env, "MASTER_PORT")) {
    e.master_port = parse_int("MASTER_PORT", *port);
    MT_CHECK(e.master_port >= 1 && e.master_port <= 65534,
             "launch env: MASTER_PORT must be in [1, 65534] (the rendezvous uses MASTER_PORT + 1); found {}",
             e.master_port);
  }
  if (e.world_size > 1 && !e.nccl_comm_id) {
    MT_CHECK(!e.master_addr.empty(),
             "launch env ({}): world size {} needs MASTER_ADDR (the host of rank 0); set it, or NCCL_COMM_ID",
             e.launcher, e.world_size);
    MT_CHECK(e.master_port != 0,
             "launch env ({}): world size {} needs MASTER_PORT (rank 0 listens on MASTER_PORT + 1); set it, or "
             "NCCL_COMM_ID",
             e.launcher, e.world_size);
  }
  return e;
}

std::vector<std::string> expand_slurm_nodelist(const std::string& nodelist) {
  MT_CHECK(!nodelist.empty(), "slurm nodelist: empty");
  std::vector<std::string> hosts;
  for (const std::string& item : split_top_level(nodelist)) {
    std::vector<std::string> expanded{""};
    for (const std::vector<std::string>& choices : parse_host_pattern(item, nodelist)) {
      MT_CHECK(expanded.size() * choices.size() <= 1000000, "slurm nodelist '{}': more than a million hosts", nodelist);
      std::vector<std::string> next;
      for (const std::string& prefix : expanded) {
        for (const std::string& c : choices) next.push_back(prefix + c);
      }
      expanded = std::move(next);
    }
    hosts.insert(hosts.end(), expanded.begin(), expanded.end());
  }
  return hosts;
}

std::string slurm_first_host(const std::string& nodelist) {
  MT_CHECK(!nodelist.empty(), "slurm nodelist: empty");
  const std::vector<std::string> items = split_top_level(nodelist);
  std::string host;
  for (const std::vector<std::string>& choices : parse_host_pattern(items.front(), nodelist)) host += choices.front();
  return host;
}

}  // namespace moetrain::dist
