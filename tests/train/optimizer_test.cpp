// Tests for train/optimizer: AdamW::step against per-tensor ops::adamw_step with PyTorch's parameter groups (decay on
// matrices only), the owned-subset step of pipeline parallelism, and (on a GPU) the bf16 compute copies it writes,
// against ParameterStore::refresh_compute_weights.
#include "train/optimizer.h"

#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/optim.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain::train {
namespace {

using testing::random_tensor;
using testing::same_bytes;

std::vector<model::ParamSpec> specs() {
  std::vector<model::ParamSpec> out;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
           {"embed", {32, 8}}, {"norm", {8}}, {"proj", {2, 8, 4}}, {"bias", {5}}}) {
    out.push_back(model::single_piece_spec(name, shape, model::ParamRole::Dense, -1, "hf." + name));
  }
  return out;
}

// Random parameters and gradients (the same for the same seed), on `device`.
void fill(model::ParameterStore& store, uint64_t seed) {
  store.init_random(seed, 0.1);
  Rng rng(seed + 1);
  for (const model::ParamSpec& spec : store.specs()) {
    store.grad(spec.name).copy_from(
        random_tensor(spec.shape, DType::F32, rng, 0.01).to(store.grad(spec.name).device()));
  }
}

const AdamWConfig kConfig{1e-2, 0.9, 0.95, 1e-8, 0.1};

TEST(AdamW, StepMatchesPerTensorUpdatesWithDecayOnMatricesOnly) {
  model::ParameterStore store(specs());
  model::ParameterStore reference(specs());
  fill(store, 5);
  fill(reference, 5);
  AdamW adamw(store, kConfig);
  std::vector<Tensor> m, v;
  for (const Tensor& p : reference.all_params()) {
    m.push_back(Tensor::zeros(p.shape(), DType::F32));
    v.push_back(Tensor::zeros(p.shape(), DType::F32));
  }
  for (int64_t step = 1; step <= 3; ++step) {
    adamw.step(1e-2 * static_cast<double>(step));
    const std::vector<Tensor> params = reference.all_params(), grads = reference.all_grads();
    for (size_t i = 0; i < params.size(); ++i) {
      const double decay = reference.specs()[i].is_matrix() ? kConfig.weight_decay : 0.0;
      ops::adamw_step(Stream::cpu(), params[i], m[i], v[i], grads[i],
                      {1e-2 * static_cast<double>(step), kConfig.beta1, kConfig.beta2, kConfig.eps, decay, step});
    }
  }
  EXPECT_EQ(adamw.steps_taken(), 3);
  for (size_t i = 0; i < m.size(); ++i) {
    SCOPED_TRACE(store.specs()[i].name);
    EXPECT_TRUE(same_bytes(store.all_params()[i], reference.all_params()[i])) << "param";
    EXPECT_TRUE(same_bytes(adamw.exp_avg()[i], m[i])) << "exp_avg";
    EXPECT_TRUE(same_bytes(adamw.exp_avg_sq()[i], v[i])) << "exp_avg_sq";
  }
  // f32 compute: every parameter is its own compute weight, so there is nothing to copy.
  for (const Tensor& c : adamw.compute_copies()) EXPECT_FALSE(c.defined());
}

TEST(AdamW, OwnedStepUpdatesOnlyTheOwnedParameters) {
  model::ParameterStore store(specs());
  model::ParameterStore reference(specs());
  fill(store, 6);
  fill(reference, 6);
  AdamW partial(store, kConfig);
  AdamW full(reference, kConfig);
  const std::vector<bool> owned{true, false, true, false};
  partial.step(1e-2, owned);
  full.step(1e-2);
  EXPECT_EQ(partial.steps_taken(), 1);
  for (size_t i = 0; i < owned.size(); ++i) {
    SCOPED_TRACE(store.specs()[i].name);
    if (owned[i]) {
      EXPECT_TRUE(same_bytes(store.all_params()[i], reference.all_params()[i]))
          << "owned param not updated as a full step";
    } else {
      model::ParameterStore untouched(specs());
      fill(untouched, 6);
      EXPECT_TRUE(same_bytes(store.all_params()[i], untouched.all_params()[i])) << "a param not owned was updated";
      EXPECT_EQ(partial.exp_avg()[i].to_vector<float>(), std::vector<float>(partial.exp_avg()[i].numel(), 0.0f));
    }
  }
  try {
    partial.step(1e-2, {true});
    ADD_FAILURE() << "expected a moetrain::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one owned flag per parameter (4) but found 1"), std::string::npos)
        << e.what();
  }
}

TEST(CudaAdamW, StepWritesTheBf16ComputeCopiesAsRefreshComputeWeightsDoes) {
  MT_REQUIRE_GPU();
  const Device cuda = Device::cuda(0);
  model::ParameterStore store(specs(), cuda, DType::BF16);
  model::ParameterStore reference(specs(), cuda, DType::BF16);
  fill(store, 7);
  fill(reference, 7);
  AdamW fused(store, kConfig);
  AdamW separate(reference, kConfig);
  separate.set_compute_copies({});  // the old way: the step writes no copies, refresh_compute_weights does
  int copies = 0;
  for (const Tensor& c : fused.compute_copies()) copies += c.defined() ? 1 : 0;
  EXPECT_EQ(copies, 2) << "the two matrices (embed, proj) have bf16 copies, the 1-D norm and bias none";
  for (int64_t step = 1; step <= 3; ++step) {
    fused.step(1e-2);
    separate.step(1e-2);
    reference.refresh_compute_weights();
  }
  for (const model::ParamSpec& spec : store.specs()) {
    SCOPED_TRACE(spec.name);
    EXPECT_TRUE(same_bytes(store.param(spec.name), reference.param(spec.name))) << "f32 master";
    EXPECT_TRUE(same_bytes(store.weight(spec.name), reference.weight(spec.name)))
        << "compute weight (" << dtype_name(store.weight(spec.name).dtype()) << ")";
  }
}

}  // namespace
}  // namespace moetrain::train
