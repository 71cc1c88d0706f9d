// defines: the device mesh: MeshShape (pp x dp x cp x ep), its resolution from the world size and
// the job's parallel settings, and Mesh, the world communicator plus one communicator per axis.
//
// Rank order: rank = ((pp_i * dp + dp_i) * cp + cp_i) * ep + ep_i. ep varies fastest, so an
// expert-parallel group is ep consecutive ranks (on one node when ep <= GPUs per node, keeping the
// all-to-all on NVLink); dp next; pp slowest (stages talk point-to-point, the least traffic).
//
// Communicators (all made with split(), so every rank of the world builds the mesh together):
//   pp    ranks with the same (dp_i, cp_i, ep_i), ordered by pp_i   (pipeline stages)
//   dp    ranks with the same (pp_i, cp_i, ep_i), ordered by dp_i   (expert-gradient sharding)
//   ep    ranks with the same (pp_i, dp_i, cp_i), ordered by ep_i   (dispatch / combine)
//   dp_ep ranks with the same (pp_i, cp_i), ordered by dp_i * ep + ep_i (non-expert parameters are
//         sharded over it, and token counts summed over it)
//
// Process-wide state: one process per GPU calls setup_mesh once and reads mesh() everywhere
// (docs/design.md section 4). Thread ranks (the in-process backend, > 1 rank) share one process, so
// they construct a Mesh each and pass it explicitly; setup_mesh refuses them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dist/communicator.h"

namespace moetrain::dist {

struct MeshShape {
  int pp = 1, dp = 1, cp = 1, ep = 1;

  int world() const { return pp * dp * cp * ep; }
  bool operator==(const MeshShape&) const = default;
  std::string str() const;  // "pp 2 x dp 2 x cp 1 x ep 2"
};

// dp = world / (pp * cp * ep). Errors: an axis < 1, pp * cp * ep not dividing the world,
// num_experts % ep != 0 when the model has experts (num_experts > 0), cp > 1 (not supported yet).
// pp > 1 is allowed. A dense model (num_experts == 0) with ep > 1 is allowed: ep then acts as
// more data parallelism (dp_ep still covers it).
MeshShape resolve_mesh(int world, int pp, int cp, int ep, int64_t num_experts);

struct MeshCoord {
  int pp = 0, dp = 0, cp = 0, ep = 0;
  bool operator==(const MeshCoord&) const = default;
};

MeshCoord mesh_coord(const MeshShape& shape, int rank);     // inverse of mesh_rank
int mesh_rank(const MeshShape& shape, const MeshCoord& c);  // the rank order above

class Mesh {
 public:
  // Collective over `world`: every rank calls it with the same shape. world->size() must equal
  // shape.world().
  Mesh(std::unique_ptr<Communicator> world, const MeshShape& shape);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  int rank() const { return world_->rank(); }

  Communicator& world() const { return *world_; }
  Communicator& pp() const { return *pp_; }
  Communicator& dp() const { return *dp_; }
  Communicator& ep() const { return *ep_; }
  Communicator& dp_ep() const { return *dp_ep_; }

 private:
  MeshShape shape_;
  MeshCoord coord_;
  std::unique_ptr<Communicator> world_, pp_, dp_, ep_, dp_ep_;
};

// Builds the process-wide mesh once; a second call is an error, as is a world of thread ranks
// (size > 1 in-process: pass their Mesh explicitly instead).
Mesh& setup_mesh(std::unique_ptr<Communicator> world, const MeshShape& shape);
bool has_mesh();
Mesh& mesh();  // the process-wide mesh; an error before setup_mesh
// Destroys the process-wide mesh and its communicators (NCCL's need the CUDA runtime, which is gone by the time
// static objects die): the CLI calls it before it returns. Nothing to do without a mesh.
void teardown_mesh();

}  // namespace moetrain::dist
