// defines: resolve_mesh, the rank <-> coordinate maps, Mesh's communicator splits and the
// process-wide mesh.
#include "dist/mesh.h"

#include <mutex>

#include "core/error.h"
#include "dist/inprocess_communicator.h"

namespace moetrain::dist {

std::string MeshShape::str() const { return fmt::format("pp {} x dp {} x cp {} x ep {}", pp, dp, cp, ep); }

MeshShape resolve_mesh(int world, int pp, int cp, int ep, int64_t num_experts) {
  MT_CHECK(world >= 1, "mesh: world size must be at least 1; found {}", world);
  MT_CHECK(pp >= 1 && cp >= 1 && ep >= 1,
           "mesh: parallel.pp, parallel.cp and parallel.ep must be >= 1; found {}, {}, {}", pp, cp, ep);
  MT_CHECK(cp == 1, "mesh: context parallelism (parallel.cp = {}) is not supported yet; set parallel.cp = 1", cp);
  MT_CHECK(num_experts >= 0, "mesh: num_experts must be >= 0; found {}", num_experts);
  const int64_t fixed = int64_t{pp} * cp * ep;
  MT_CHECK(world % fixed == 0, "mesh: world size {} is not divisible by pp ({}) x cp ({}) x ep ({}) = {}", world, pp,
           cp, ep, fixed);
  MT_CHECK(num_experts == 0 || num_experts % ep == 0, "mesh: num_experts ({}) is not divisible by parallel.ep ({})",
           num_experts, ep);
  return MeshShape{pp, static_cast<int>(world / fixed), cp, ep};
}

int mesh_rank(const MeshShape& s, const MeshCoord& c) { return ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.ep + c.ep; }

MeshCoord mesh_coord(const MeshShape& s, int rank) {
  MT_CHECK(rank >= 0 && rank < s.world(), "mesh: rank {} is outside the mesh {} ({} ranks)", rank, s.str(), s.world());
  MeshCoord c;
  c.ep = rank % s.ep;
  rank /= s.ep;
  c.cp = rank % s.cp;
  rank /= s.cp;
  c.dp = rank % s.dp;
  c.pp = rank / s.dp;
  return c;
}

Mesh::Mesh(std::unique_ptr<Communicator> world, const MeshShape& shape) : shape_(shape), world_(std::move(world)) {
  MT_CHECK(world_ != nullptr, "mesh: no world communicator");
  MT_CHECK(shape.pp >= 1 && shape.dp >= 1 && shape.cp >= 1 && shape.ep >= 1, "mesh: every axis must be >= 1; found {}",
           shape.str());
  MT_CHECK(world_->size() == shape.world(), "mesh: {} needs {} ranks but communicator '{}' has {}", shape.str(),
           shape.world(), world_->name(), world_->size());
  coord_ = mesh_coord(shape, world_->rank());
  const MeshShape& s = shape_;
  const MeshCoord& c = coord_;
  // Colors index the coordinates held fixed; keys order the group along its axis. Every rank
  // performs the same four splits in the same order.
  pp_ = world_->split((c.dp * s.cp + c.cp) * s.ep + c.ep, c.pp, "pp");
  dp_ = world_->split((c.pp * s.cp + c.cp) * s.ep + c.ep, c.dp, "dp");
  ep_ = world_->split((c.pp * s.dp + c.dp) * s.cp + c.cp, c.ep, "ep");
  dp_ep_ = world_->split(c.pp * s.cp + c.cp, c.dp * s.ep + c.ep, "dp_ep");
}

Mesh::~Mesh() = default;

namespace {
std::mutex g_mesh_mu;
std::unique_ptr<Mesh> g_mesh;
}  // namespace

Mesh& setup_mesh(std::unique_ptr<Communicator> world, const MeshShape& shape) {
  MT_CHECK(world != nullptr, "mesh: setup_mesh needs a world communicator");
  MT_CHECK(!(is_local_communicator(*world) && world->size() > 1),
           "mesh: setup_mesh stores one mesh per process, but '{}' has {} thread ranks in this process; construct a "
           "Mesh per rank and pass it explicitly",
           world->name(), world->size());
  std::lock_guard lock(g_mesh_mu);
  MT_CHECK(g_mesh == nullptr, "mesh: setup_mesh was already called (the mesh is {}); it is set once per process",
           g_mesh->shape().str());
  g_mesh = std::make_unique<Mesh>(std::move(world), shape);
  return *g_mesh;
}

bool has_mesh() {
  std::lock_guard lock(g_mesh_mu);
  return g_mesh != nullptr;
}

Mesh& mesh() {
  std::lock_guard lock(g_mesh_mu);
  MT_CHECK(g_mesh != nullptr, "mesh: mesh() called before setup_mesh");
  return *g_mesh;
}

void teardown_mesh() {
  std::unique_ptr<Mesh> mesh;
  {
    std::lock_guard lock(g_mesh_mu);
    mesh = std::move(g_mesh);
  }
  mesh.reset();  // outside the lock: destroying communicators may wait for their streams
}

}  // namespace moetrain::dist
