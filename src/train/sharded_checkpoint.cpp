// defines: saving a sharded checkpoint from the shards, and resuming the shards from a sharded or replicated one.
#include "train/sharded_checkpoint.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "dist/mesh.h"
#include "ops/cuda/runtime.h"
#include "ops/elementwise.h"
#include "train/checkpoint.h"

namespace moetrain::train {

namespace {

using nlohmann::json;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

constexpr const char* kKinds[] = {"param/", "exp_avg/", "exp_avg_sq/"};

// The elements of the flattened tensor that this rank's shard holds: [first, first + count) (count 0 past the end).
std::pair<int64_t, int64_t> own_slice(const dist::ShardedTensor& t) {
  const int64_t first = t.begin() + t.comm().rank() * t.shard_numel();
  const int64_t count = std::clamp<int64_t>(t.end() - first, 0, t.shard_numel());
  return {std::min(first, t.end()), count};
}

// The three shards of tensor i: master, first moment, second moment.
std::vector<Tensor> shards_of(const FullyShardedModel& sharded, const AdamW& optimizer, size_t i) {
  return {sharded.tensors()[i].master_shard(), optimizer.exp_avg()[i], optimizer.exp_avg_sq()[i]};
}

// Every rank returns once all of `comm` got here; a device queue is drained first (files are the host's).
void host_barrier(dist::Communicator& comm, Device device) {
  comm.barrier(default_stream(device));
  if (device.is_cuda()) ops::cuda::synchronize(device);
}

// Writes `shard` (this rank's values, the valid `count` first) and its moments into the three shard tensors.
void apply(FullyShardedModel& sharded, AdamW& optimizer, size_t i, const std::vector<Tensor>& values) {
  const std::vector<Tensor> targets = shards_of(sharded, optimizer, i);
  for (size_t k = 0; k < targets.size(); ++k) {
    Tensor target = targets[k];
    target.zero_();
    if (values[k].numel() > 0) target.slice(0, values[k].numel()).copy_from(values[k]);
  }
  const dist::ShardedTensor& t = sharded.tensors()[i];
  if (!t.weight_is_master())  // the bf16 compute shard follows its master, as the optimizer's step writes it
    ops::cast(default_stream(t.master_shard().device()), t.weight_shard(), t.master_shard());
}

// The internal full tensors (CPU) of a whole checkpoint's HF-named model tensors, by the store's pieces.
std::vector<Tensor> internal_from_hf(const model::ParameterStore& store, const NamedTensors& hf,
                                     const std::string& path) {
  std::map<std::string, Tensor> by_name(hf.begin(), hf.end());
  std::vector<Tensor> out;
  for (const model::ParamSpec& spec : store.specs()) {
    Tensor full = Tensor::zeros(spec.shape, DType::F32);
    for (const model::HfPiece& piece : spec.pieces) {
      const auto it = by_name.find(piece.hf_name);
      MT_CHECK(it != by_name.end() && it->second.shape() == piece.hf_shape,
               "checkpoint {}: model tensor '{}' is {} but {} was expected", path, piece.hf_name,
               it == by_name.end() ? std::string("missing") : it->second.describe(), shape_str(piece.hf_shape));
      model::place_piece(full, piece, it->second);
    }
    out.push_back(full);
  }
  return out;
}

}  // namespace

std::string save_sharded_checkpoint(const FullyShardedModel& sharded, const AdamW& optimizer, dist::Mesh& mesh,
                                    const io::JobConfig& config, int64_t step, const json& state) {
  dist::Communicator& comm = mesh.dp_ep();
  const Device device = sharded.model().device();
  const auto& specs = sharded.model().params().specs();
  NamedTensors mine;
  std::vector<int64_t> slices;  // per tensor: first, count
  for (size_t i = 0; i < sharded.tensors().size(); ++i) {
    const auto [first, count] = own_slice(sharded.tensors()[i]);
    slices.push_back(first);
    slices.push_back(count);
    if (count == 0) continue;
    const std::vector<Tensor> values = shards_of(sharded, optimizer, i);
    for (size_t k = 0; k < values.size(); ++k)
      mine.emplace_back(kKinds[k] + specs[i].name, values[k].slice(0, count).to(Device::cpu()));
  }
  // Every rank's slices, for the layout rank 0 writes.
  const int world = comm.size();
  Tensor local = Tensor::from_vector(slices, {static_cast<int64_t>(slices.size())});
  Tensor all = Tensor::empty({static_cast<int64_t>(world) * local.numel()}, DType::I64, device);
  comm.all_gather(default_stream(device), all, device.is_cpu() ? local : local.to(device));
  const std::vector<int64_t> every = all.to_vector<int64_t>();

  const std::string& dir = config.checkpoint.dir;
  if (comm.rank() == 0) prepare_sharded_checkpoint(dir, step);
  host_barrier(comm, device);
  write_checkpoint_shard(dir, step, comm.rank(), world, mine);
  host_barrier(comm, device);
  std::string path;
  if (comm.rank() == 0) {
    json tensors = json::array();
    for (size_t i = 0; i < specs.size(); ++i) {
      json hf = json::array();
      for (const model::HfPiece& piece : specs[i].pieces) hf.push_back(model::piece_to_json(piece));
      for (size_t k = 0; k < 3; ++k) {
        json entry = {{"name", kKinds[k] + specs[i].name}, {"shape", specs[i].shape}, {"slices", json::array()}};
        for (int r = 0; r < world; ++r) {
          const size_t at = static_cast<size_t>(r) * slices.size() + 2 * i;
          entry["slices"].push_back({every[at], every[at + 1]});
        }
        if (k == 0) entry["hf"] = hf;
        tensors.push_back(std::move(entry));
      }
    }
    CheckpointData data;
    data.step = step;
    data.state = state;
    data.config_toml = io::job_config_to_toml(config);
    path = complete_sharded_checkpoint(dir, data, {{"world", world}, {"tensors", tensors}}, config.checkpoint.keep);
    log_info("checkpoint: {} (sharded over {} ranks)", path, world);
  }
  host_barrier(comm, device);  // no rank goes on (or saves again) before the folder is complete
  return path;
}

json resume_sharded_checkpoint(FullyShardedModel& sharded, AdamW& optimizer, dist::Mesh& mesh, const std::string& path,
                               const std::function<void(const json&)>& check_state) {
  const auto& specs = sharded.model().params().specs();
  const int rank = mesh.dp_ep().rank(), world = mesh.dp_ep().size();
  std::vector<std::vector<Tensor>> values(specs.size());  // per tensor: master, exp_avg, exp_avg_sq (valid part)
  json state;
  bool from_own_file = false;
  bool converted = false;  // moments kept in the other dtype than optim.state_dtype
  if (is_sharded_checkpoint(path) && sharded_checkpoint_world(path) == world) {
    CheckpointShard shard = load_checkpoint_shard(path, rank);
    std::map<std::string, json> layout;
    for (const json& t : shard.layout["tensors"]) layout[t["name"].get<std::string>()] = t;
    from_own_file = true;
    for (size_t i = 0; i < specs.size() && from_own_file; ++i) {
      const auto [first, count] = own_slice(sharded.tensors()[i]);
      for (const char* kind : kKinds) {
        const auto it = layout.find(kind + specs[i].name);
        from_own_file = from_own_file && it != layout.end() &&
                        it->second["slices"][static_cast<size_t>(rank)] == json::array({first, count});
      }
    }
    if (from_own_file) {
      std::map<std::string, Tensor> mine(shard.tensors.begin(), shard.tensors.end());
      for (size_t i = 0; i < specs.size(); ++i) {
        const int64_t count = own_slice(sharded.tensors()[i]).second;
        for (const char* kind : kKinds) {
          const auto it = mine.find(kind + specs[i].name);
          const bool is_param = std::string_view(kind) == "param/";
          const bool found = it != mine.end();
          MT_CHECK(
              count == 0 || (found && it->second.numel() == count &&
                             (it->second.dtype() == DType::F32 || (!is_param && it->second.dtype() == DType::BF16))),
              "checkpoint {}: rank {}'s file should hold {}[{}] '{}{}' but has {}", path, rank,
              is_param ? "f32" : "f32 or bf16", count, kind, specs[i].name,
              found ? it->second.describe() : std::string("none"));
          const DType dtype = is_param ? DType::F32 : optimizer.state_dtype();
          if (count == 0) {
            values[i].push_back(Tensor::zeros({0}, dtype));
            continue;
          }
          const Tensor flat = it->second.view({-1});
          if (flat.dtype() == dtype) {
            values[i].push_back(flat);
            continue;
          }
          converted = true;
          values[i].push_back(flat.to(dtype));
        }
      }
      state = shard.state;
    }
  }
  if (!from_own_file) {  // another mesh, or a replicated checkpoint: the whole, then this rank's shards of it
    const CheckpointData data = load_checkpoint(path);
    const std::vector<Tensor> masters = internal_from_hf(sharded.model().params(), data.model, path);
    std::map<std::string, Tensor> moments(data.optimizer.begin(), data.optimizer.end());
    for (size_t i = 0; i < specs.size(); ++i) {
      std::vector<Tensor> full = {masters[i]};
      for (const char* kind : {"exp_avg/", "exp_avg_sq/"}) {
        full.push_back(
            moment_for_job(moments, kind + specs[i].name, specs[i].shape, optimizer.state_dtype(), path, &converted));
      }
      const int64_t count = own_slice(sharded.tensors()[i]).second;
      for (const Tensor& f : full)
        values[i].push_back(sharded.tensors()[i].take_shard(f).to(Device::cpu()).slice(0, count));
    }
    state = data.state;
    log_info("checkpoint: {} read whole and sharded over {} ranks", path, world);
  }
  check_state(state);
  for (size_t i = 0; i < specs.size(); ++i) apply(sharded, optimizer, i, values[i]);
  if (converted) log_info("{}", moments_converted_line(path, optimizer.state_dtype()));
  return state;
}

}  // namespace moetrain::train
