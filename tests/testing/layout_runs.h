// defines: what the layout-parity tests share: a job trained on one rank or on pp x ep (x dp) thread ranks, the first
// replica's losses, gradient norms and parameters assembled from its pipeline ranks, and the two comparisons the
// executors promise: bit for bit, or within the fp32 summation-order tolerance (1e-5 relative) where ranks sum
// gradients in another order.
#pragma once

#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dist/inprocess_communicator.h"
#include "dist/mesh.h"
#include "io/job_config.h"
#include "model/model_config.h"
#include "testing/test_data.h"
#include "train/trainer.h"

namespace moetrain::testing {

struct LayoutRun {
  std::vector<double> losses, grad_norms;
  std::map<std::string, std::vector<float>> params;  // the parameters the replica's ranks own, by name
};

inline LayoutRun layout_result(train::Trainer& trainer, const train::TrainSummary& summary) {
  LayoutRun r{summary.losses, summary.grad_norms, {}};
  const auto& specs = trainer.model().params().specs();
  const std::vector<Tensor> params = trainer.full_parameters();
  for (size_t i = 0; i < specs.size(); ++i)
    if (trainer.owns_parameter(i)) r.params[specs[i].name] = params[i].to_vector<float>();
  return r;
}

inline LayoutRun run_one_rank(const io::JobConfig& config) {
  train::Trainer trainer(config);
  const train::TrainSummary summary = trainer.run();
  return layout_result(trainer, summary);
}

// pp x ep x dp thread ranks; the replica of dp rank 0 and ep rank 0, assembled from its pp ranks.
inline LayoutRun run_layout(const io::JobConfig& config, int pp, int ep, int dp = 1) {
  const int world = pp * ep * dp;
  const int64_t experts = model::load_model_config(config.model.config).num_experts;
  LayoutRun whole;
  std::mutex mu;
  dist::run_local_ranks(world, [&](dist::Communicator& comm) {
    dist::Mesh mesh(comm.split(0, comm.rank(), "world"), dist::resolve_mesh(world, pp, 1, ep, experts));
    train::Trainer trainer(config, &mesh);
    const train::TrainSummary summary = trainer.run();
    LayoutRun mine = layout_result(trainer, summary);
    if (mesh.coord().ep != 0 || mesh.coord().dp != 0) return;
    std::lock_guard lock(mu);
    whole.losses = mine.losses;
    whole.grad_norms = mine.grad_norms;
    for (auto& [name, values] : mine.params) whole.params.emplace(name, std::move(values));
  });
  return whole;
}

inline void expect_bitwise(const LayoutRun& got, const LayoutRun& want, const std::string& where) {
  EXPECT_EQ(got.losses, want.losses) << where;
  EXPECT_EQ(got.grad_norms, want.grad_norms) << where;
  ASSERT_EQ(got.params.size(), want.params.size()) << where;
  for (const auto& [name, values] : want.params) {
    const auto it = got.params.find(name);
    ASSERT_NE(it, got.params.end()) << where << ": " << name;
    EXPECT_TRUE(it->second == values) << where << ": " << name << " differs";
  }
}

// Within fp32 summation order: losses and gradient norms to 1e-5 relative, each parameter to `param_tolerance(name)`
// relative (by default 1e-5).
inline void expect_close(const LayoutRun& got, const LayoutRun& want, const std::string& where,
                         const std::function<double(const std::string&)>& param_tolerance = nullptr) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << where;
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::abs(want.losses[i])) << where << " step " << i + 1;
    EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-5 * std::abs(want.grad_norms[i])) << where;
  }
  ASSERT_EQ(got.params.size(), want.params.size()) << where;
  for (const auto& [name, values] : want.params) {
    const std::vector<float>& other = got.params.at(name);
    const Tensor a = Tensor::from_vector(other, {int64_t(other.size())});
    const Tensor b = Tensor::from_vector(values, {int64_t(values.size())});
    EXPECT_LT(relative_error(a, b), param_tolerance ? param_tolerance(name) : 1e-5) << where << ": " << name;
  }
}

}  // namespace moetrain::testing
