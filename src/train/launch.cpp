// defines: the launch of a training job on its ranks.
#include "train/launch.h"

#include <chrono>
#include <memory>

#include "core/error.h"
#include "core/log.h"
#include "dist/bootstrap.h"
#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "dist/nccl_communicator.h"
#include "model/model_config.h"
#include "train/memory_fit.h"

namespace moetrain::train {

namespace {

dist::MeshShape mesh_for(const io::JobConfig& config, int world) {
  const model::ModelConfig model = model::load_model_config(config.model.config);
  return dist::resolve_mesh(world, static_cast<int>(config.parallel.pp), static_cast<int>(config.parallel.cp),
                            static_cast<int>(config.parallel.ep), model.num_experts);
}

dist::Mesh& connect_process_mesh(io::JobConfig& config, const dist::LaunchEnv& env, bool check_memory_fit) {
  MT_CHECK(config.model.device != "cpu",
           "launch: {} started {} processes, but model.device is cpu (processes run one GPU each over NCCL; for CPU "
           "ranks use dist.local_ranks)",
           env.launcher, env.world_size);
  setup_logging(LogLevel::Info, env.rank);
  const dist::MeshShape shape = mesh_for(config, env.world_size);
  config.model.device = fmt::format("cuda:{}", env.local_rank);  // one GPU per process, picked by the local rank
  log_info("launch: rank {} of {} ({}), {}, mesh {}", env.rank, env.world_size, env.launcher, config.model.device,
           shape.str());
  // Before the rendezvous: every rank of a job too large for its GPU stops here, none waits for the others.
  if (check_memory_fit) check_job_fits_memory(config, env.world_size);
  dist::NcclOptions options;
  options.timeout = std::chrono::seconds(config.dist.timeout_s);
  dist::RendezvousOptions rendezvous;
  rendezvous.timeout = options.timeout;
  return dist::setup_mesh(dist::connect_nccl_world(env, Device::cuda(env.local_rank), options, rendezvous), shape);
}

}  // namespace

dist::Mesh* setup_process_mesh(io::JobConfig& config, bool check_memory_fit) {
  const dist::LaunchEnv env = dist::read_launch_env(dist::process_env());
  if (env.world_size > 1) return &connect_process_mesh(config, env, check_memory_fit);
  mesh_for(config, 1);  // refuses a parallel.* that one rank cannot hold
  if (check_memory_fit) check_job_fits_memory(config, 1);
  return nullptr;
}

dist::MeshShape job_mesh_shape(const io::JobConfig& config, int world) { return mesh_for(config, world); }

void run_on_thread_ranks(const io::JobConfig& config, const std::function<void(dist::Mesh&)>& fn) {
  const int world = static_cast<int>(config.dist.local_ranks);
  const Device device = parse_device(config.model.device);
  const dist::MeshShape shape = mesh_for(config, world);
  log_info(
      "launch: {} thread ranks on {}, mesh {}{}", world, device.str(), shape.str(),
      device.is_cuda() ? " (sharing the GPU: one rank runs at a time, collectives staged through host memory)" : "");
  dist::LocalWorldOptions options;
  options.timeout = std::chrono::seconds(config.dist.timeout_s);
  options.device = device;
  dist::run_local_ranks(
      world,
      [&](dist::Communicator& comm) {
        dist::Mesh mesh(comm.split(0, comm.rank(), "world"), shape);
        fn(mesh);
      },
      options);
}

TrainSummary run_training_job(const io::JobConfig& config) {
  if (config.dist.local_ranks > 1) {
    // A mesh error before a memory one. Thread ranks on a GPU share its memory: the fit check is the CPU's only.
    mesh_for(config, static_cast<int>(config.dist.local_ranks));
    if (config.model.device == "cpu") check_job_fits_memory(config, static_cast<int>(config.dist.local_ranks));
    TrainSummary first;
    run_on_thread_ranks(config, [&](dist::Mesh& mesh) {
      Trainer trainer(config, &mesh);
      TrainSummary summary = trainer.run();
      if (mesh.rank() == 0) first = std::move(summary);
    });
    return first;
  }
  io::JobConfig local = config;
  dist::Mesh* mesh = setup_process_mesh(local, true);
  Trainer trainer(local, mesh);
  return trainer.run();
}

}  // namespace moetrain::train
