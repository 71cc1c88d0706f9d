// Tests for dist/bootstrap: the launcher environments (torchrun, Slurm, Open MPI, none), their
// validation, and Slurm nodelist parsing.
#include "dist/bootstrap.h"

#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "testing/error_message.h"

namespace moetrain::dist {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

void expect_env_error(const std::map<std::string, std::string>& vars, std::string_view part) {
  testing::expect_error([&] { read_launch_env(env_of(vars)); }, part);
}

TEST(LaunchEnv, NoLauncherIsASingleProcessWorld) {
  const LaunchEnv e = read_launch_env(env_of({}));
  EXPECT_EQ(e.launcher, "none");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_FALSE(e.nccl_comm_id);
}

TEST(LaunchEnv, ReadsTorchrun) {
  const LaunchEnv e = read_launch_env(env_of({{"RANK", "5"},
                                              {"WORLD_SIZE", "8"},
                                              {"LOCAL_RANK", "1"},
                                              {"LOCAL_WORLD_SIZE", "4"},
                                              {"MASTER_ADDR", "node01"},
                                              {"MASTER_PORT", "29500"},
                                              {"SLURM_PROCID", "0"}}));  // torchrun under sbatch
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "node01");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(e.rendezvous_port(), 29501);
}

TEST(LaunchEnv, ReadsOpenMpiAheadOfSlurm) {
  const LaunchEnv e = read_launch_env(env_of({{"OMPI_COMM_WORLD_RANK", "3"},
                                              {"OMPI_COMM_WORLD_SIZE", "4"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                              {"SLURM_PROCID", "0"},
                                              {"MASTER_ADDR", "10.0.0.1"},
                                              {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(e.launcher, "mpi");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
}

TEST(LaunchEnv, OpenMpiStillNeedsMasterAddress) {
  expect_env_error({{"OMPI_COMM_WORLD_RANK", "0"},
                    {"OMPI_COMM_WORLD_SIZE", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                   "launch env (mpi): world size 2 needs MASTER_ADDR");
  expect_env_error({{"OMPI_COMM_WORLD_RANK", "0"},
                    {"OMPI_COMM_WORLD_SIZE", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                    {"MASTER_ADDR", "h"}},
                   "needs MASTER_PORT");
}

TEST(LaunchEnv, ReadsSlurmWithTheFirstHostAsMaster) {
  const LaunchEnv e = read_launch_env(env_of({{"SLURM_PROCID", "6"},
                                              {"SLURM_NTASKS", "8"},
                                              {"SLURM_LOCALID", "2"},
                                              {"SLURM_NTASKS_PER_NODE", "4"},
                                              {"SLURM_JOB_NODELIST", "gpu[07-08,11],login"},
                                              {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "gpu07");
}

TEST(LaunchEnv, SlurmMasterAddrOverridesTheNodelist) {
  const LaunchEnv e = read_launch_env(env_of({{"SLURM_PROCID", "0"},
                                              {"SLURM_NTASKS", "2"},
                                              {"SLURM_LOCALID", "0"},
                                              {"SLURM_NTASKS_PER_NODE", "2"},
                                              {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                                              {"MASTER_ADDR", "10.1.1.1"},
                                              {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(e.master_addr, "10.1.1.1");
}

TEST(LaunchEnv, SlurmDerivesTasksPerNode) {
  // From SLURM_TASKS_PER_NODE "3(x2),1" and the node id: node 2 runs 1 task.
  LaunchEnv e = read_launch_env(env_of({{"SLURM_PROCID", "6"},
                                        {"SLURM_NTASKS", "7"},
                                        {"SLURM_LOCALID", "0"},
                                        {"SLURM_NODEID", "2"},
                                        {"SLURM_TASKS_PER_NODE", "3(x2),1"},
                                        {"SLURM_JOB_NODELIST", "a[1-3]"},
                                        {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(e.local_world_size, 1);
  e = read_launch_env(env_of({{"SLURM_PROCID", "1"},
                              {"SLURM_NTASKS", "7"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NODEID", "0"},
                              {"SLURM_TASKS_PER_NODE", "3(x2),1"},
                              {"SLURM_JOB_NODELIST", "a[1-3]"},
                              {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(e.local_world_size, 3);
  // From SLURM_NTASKS / SLURM_JOB_NUM_NODES.
  e = read_launch_env(env_of({{"SLURM_PROCID", "1"},
                              {"SLURM_NTASKS", "8"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_JOB_NUM_NODES", "2"},
                              {"SLURM_JOB_NODELIST", "a[1-2]"},
                              {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(e.local_world_size, 4);
  expect_env_error({{"SLURM_PROCID", "1"},
                    {"SLURM_NTASKS", "7"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_JOB_NUM_NODES", "2"},
                    {"SLURM_JOB_NODELIST", "a[1-2]"},
                    {"MASTER_PORT", "29500"}},
                   "cannot be divided over SLURM_JOB_NUM_NODES (2)");
}

TEST(LaunchEnv, NcclCommIdReplacesTheMasterAddress) {
  const LaunchEnv e = read_launch_env(env_of(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"NCCL_COMM_ID", "h:1"}}));
  EXPECT_TRUE(e.nccl_comm_id);
  EXPECT_TRUE(e.master_addr.empty());
}

TEST(LaunchEnv, RejectsInconsistentOrMalformedValues) {
  const std::map<std::string, std::string> good = {{"RANK", "1"},        {"WORLD_SIZE", "2"},
                                                   {"LOCAL_RANK", "1"},  {"LOCAL_WORLD_SIZE", "2"},
                                                   {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  read_launch_env(env_of(good));
  const auto with = [&](const std::string& key, const std::string& value) {
    auto vars = good;
    vars[key] = value;
    return vars;
  };
  const auto without = [&](const std::string& key) {
    auto vars = good;
    vars.erase(key);
    return vars;
  };
  expect_env_error(with("RANK", "2"), "rank 2 is not below the world size 2");
  expect_env_error(with("RANK", "one"), "RANK must be a non-negative integer; found 'one'");
  expect_env_error(with("RANK", "-1"), "RANK must be a non-negative integer; found '-1'");
  expect_env_error(with("WORLD_SIZE", "2x"), "WORLD_SIZE must be a non-negative integer; found '2x'");
  expect_env_error(with("WORLD_SIZE", "0"), "the world size must be at least 1; found 0");
  expect_env_error(with("LOCAL_RANK", "2"), "local rank 2 is not below the local world size 2");
  expect_env_error(with("LOCAL_WORLD_SIZE", "3"), "the local world size must be in [1, world size 2]; found 3");
  expect_env_error(with("MASTER_PORT", "http"), "MASTER_PORT must be a non-negative integer; found 'http'");
  expect_env_error(with("MASTER_PORT", "65535"), "MASTER_PORT must be in [1, 65534]");
  expect_env_error(without("MASTER_ADDR"), "launch env (torchrun): world size 2 needs MASTER_ADDR");
  expect_env_error(without("WORLD_SIZE"), "launch env (torchrun): WORLD_SIZE is not set");
  expect_env_error({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}}, "launch env (slurm): SLURM_NPROCS is not set");
}

TEST(SlurmNodelist, ExpandsRangesListsAndPadding) {
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07],other"),
            (std::vector<std::string>{"node01", "node02", "node03", "node04", "node07", "other"}));
  EXPECT_EQ(expand_slurm_nodelist("a"), (std::vector<std::string>{"a"}));
  EXPECT_EQ(expand_slurm_nodelist("n[8-10]"), (std::vector<std::string>{"n8", "n9", "n10"}));
  EXPECT_EQ(expand_slurm_nodelist("rack[1-2]-gpu[1-2]"),
            (std::vector<std::string>{"rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"}));
  EXPECT_EQ(expand_slurm_nodelist("x[098-100]y,z[3]"), (std::vector<std::string>{"x098y", "x099y", "x100y", "z3"}));
}

TEST(SlurmNodelist, FirstHost) {
  EXPECT_EQ(slurm_first_host("node[01-04,07],other"), "node01");
  EXPECT_EQ(slurm_first_host("login,node[1-2]"), "login");
  EXPECT_EQ(slurm_first_host("rack[3-4]-gpu[09,11]"), "rack3-gpu09");
}

TEST(SlurmNodelist, RejectsMalformedLists) {
  for (const std::string bad :
       {"node[01-04", "node]1[", "node[4-1]", "node[a-b]", "node[]", "node[1,]", "a,,b", "", "n[[1]]"}) {
    EXPECT_THROW(expand_slurm_nodelist(bad), Error) << bad;
  }
  try {
    slurm_first_host("node[4-1]");
    ADD_FAILURE() << "a reversed range must fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slurm nodelist 'node[4-1]': range '4-1' runs backwards"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moetrain::dist
