// Tests for dist/mesh: resolving the mesh shape and its errors, the rank order, and the axis
// communicators a Mesh splits from the world (on thread ranks).
#include "dist/mesh.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.h"
#include "dist/inprocess_communicator.h"
#include "testing/error_message.h"

namespace moetrain::dist {
namespace {

using testing::expect_error;

TEST(ResolveMesh, DerivesDataParallelFromTheWorld) {
  EXPECT_EQ(resolve_mesh(8, 1, 1, 1, 0), (MeshShape{1, 8, 1, 1}));
  EXPECT_EQ(resolve_mesh(8, 2, 1, 2, 128), (MeshShape{2, 2, 1, 2}));
  EXPECT_EQ(resolve_mesh(16, 1, 1, 8, 64), (MeshShape{1, 2, 1, 8}));
  EXPECT_EQ(resolve_mesh(4, 4, 1, 1, 8), (MeshShape{4, 1, 1, 1}));  // pp > 1 is allowed
  EXPECT_EQ(resolve_mesh(4, 1, 1, 2, 0), (MeshShape{1, 2, 1, 2}));  // dense: ep acts as data parallel
  EXPECT_EQ(resolve_mesh(1, 1, 1, 1, 0), (MeshShape{1, 1, 1, 1}));
}

TEST(ResolveMesh, RejectsShapesThatDoNotFit) {
  expect_error([] { resolve_mesh(6, 1, 1, 4, 8); }, "world size 6 is not divisible by pp (1) x cp (1) x ep (4) = 4");
  expect_error([] { resolve_mesh(8, 2, 1, 3, 6); }, "world size 8 is not divisible by pp (2) x cp (1) x ep (3) = 6");
  expect_error([] { resolve_mesh(6, 1, 1, 3, 128); }, "num_experts (128) is not divisible by parallel.ep (3)");
  expect_error([] { resolve_mesh(4, 1, 2, 1, 0); }, "context parallelism (parallel.cp = 2) is not supported yet");
  expect_error([] { resolve_mesh(4, 0, 1, 1, 0); }, "must be >= 1; found 0, 1, 1");
  expect_error([] { resolve_mesh(0, 1, 1, 1, 0); }, "world size must be at least 1; found 0");
}

TEST(MeshCoord, EpIsTheFastestAxis) {
  const MeshShape s{2, 3, 1, 2};
  EXPECT_EQ(mesh_coord(s, 0), (MeshCoord{0, 0, 0, 0}));
  EXPECT_EQ(mesh_coord(s, 1), (MeshCoord{0, 0, 0, 1}));
  EXPECT_EQ(mesh_coord(s, 2), (MeshCoord{0, 1, 0, 0}));
  EXPECT_EQ(mesh_coord(s, 6), (MeshCoord{1, 0, 0, 0}));
  EXPECT_EQ(mesh_coord(s, 11), (MeshCoord{1, 2, 0, 1}));
  for (int r = 0; r < s.world(); ++r) EXPECT_EQ(mesh_rank(s, mesh_coord(s, r)), r);
  EXPECT_THROW(mesh_coord(s, 12), Error);
}

TEST(Mesh, SplitsTheWorldIntoAxisGroups) {
  // pp 2 x dp 2 x ep 2 on 8 thread ranks: rank = (pp * 2 + dp) * 2 + ep.
  const MeshShape shape{2, 2, 1, 2};
  run_local_ranks(8, [&](Communicator& world_view) {
    // The Mesh takes ownership of a world communicator; a split of the view with one color is
    // the world again, in the same order.
    Mesh m(world_view.split(0, world_view.rank(), "world"), shape);
    const MeshCoord c = m.coord();
    const int r = m.rank();
    EXPECT_EQ(c, mesh_coord(shape, r));
    EXPECT_EQ(m.pp().size(), 2);
    EXPECT_EQ(m.dp().size(), 2);
    EXPECT_EQ(m.ep().size(), 2);
    EXPECT_EQ(m.dp_ep().size(), 4);
    EXPECT_EQ(m.pp().rank(), c.pp);
    EXPECT_EQ(m.dp().rank(), c.dp);
    EXPECT_EQ(m.ep().rank(), c.ep);
    EXPECT_EQ(m.dp_ep().rank(), c.dp * 2 + c.ep);
    EXPECT_EQ(m.ep().name(), "ep");
    // Each group gathers the world ranks it holds, in its own rank order.
    const auto members = [&](Communicator& g) {
      Tensor in = Tensor::from_vector<int32_t>({r}, {1});
      Tensor out = Tensor::zeros({g.size()}, DType::I32);
      g.all_gather(Stream::cpu(), out, in);
      return out.to_vector<int32_t>();
    };
    EXPECT_EQ(members(m.ep()), (std::vector<int32_t>{r - c.ep, r - c.ep + 1}));
    EXPECT_EQ(members(m.dp()), (std::vector<int32_t>{r - 2 * c.dp, r - 2 * c.dp + 2}));
    EXPECT_EQ(members(m.pp()), (std::vector<int32_t>{r - 4 * c.pp, r - 4 * c.pp + 4}));
    const int base = 4 * c.pp;
    EXPECT_EQ(members(m.dp_ep()), (std::vector<int32_t>{base, base + 1, base + 2, base + 3}));
  });
}

TEST(Mesh, RejectsAWorldOfTheWrongSize) {
  std::shared_ptr<LocalWorld> world = LocalWorld::create(1);
  expect_error(
      [&] {
        Mesh m(world->communicator(0), MeshShape{1, 2, 1, 1});
      },
      "pp 1 x dp 2 x cp 1 x ep 1 needs 2 ranks but communicator 'world' has 1");
}

TEST(Mesh, SetupMeshRefusesThreadRanks) {
  // Thread ranks pass their Mesh explicitly.
  run_local_ranks(2, [](Communicator& c) {
    std::unique_ptr<Communicator> world = c.split(0, c.rank(), "world");
    expect_error([&] { setup_mesh(std::move(world), MeshShape{1, 2, 1, 1}); }, "pass it explicitly");
  });
  EXPECT_FALSE(has_mesh());
}

TEST(Mesh, ProcessWideMeshIsSetOnce) {
  // setup_mesh changes process-wide state for good, so it runs in a child process (fresh state
  // on every run of the suite); the child exits 0 only when every check held.
  EXPECT_EXIT(
      {
        bool ok = !has_mesh();
        try {
          mesh();
          ok = false;
        } catch (const Error& e) {
          ok = ok && std::string(e.what()).find("mesh() called before setup_mesh") != std::string::npos;
        }
        // A single-rank world is a process-wide mesh like one GPU process.
        std::shared_ptr<LocalWorld> one = LocalWorld::create(1);
        Mesh& m = setup_mesh(one->communicator(0), MeshShape{});
        ok = ok && has_mesh() && &mesh() == &m && mesh().dp_ep().size() == 1;
        try {
          std::shared_ptr<LocalWorld> again = LocalWorld::create(1);
          setup_mesh(again->communicator(0), MeshShape{});
          ok = false;
        } catch (const Error& e) {
          ok = ok && std::string(e.what()).find("setup_mesh was already called") != std::string::npos;
        }
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace moetrain::dist
