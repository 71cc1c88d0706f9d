// Tests for the shared expert block (model/blocks/shared_expert.*): its parameters are a dense gated MLP's with the
// shared-expert role, its forward, input gradient and weight gradients are bitwise a dense GatedMlp's on the same
// weights, and the sigmoid gate it does not run is refused by name.
#include "model/blocks/shared_expert.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "model/blocks/gated_mlp.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using block_testing::contains;
using block_testing::error_message;
using block_testing::fill_random;
using block_testing::values;
using block_testing::with_whole_pieces;
using testing::random_tensor;

constexpr int64_t kHidden = 12, kWidth = 20;

SharedExpertOptions shared_options() {
  SharedExpertOptions o;
  o.hidden_size = kHidden;
  o.intermediate_size = kWidth;
  return o;
}

TEST(SharedExpertBlock, ParamSpecsAreADenseGatedMlpsWithTheSharedExpertRole) {
  const auto specs = SharedExpert::param_specs(shared_options(), "layers.2.shared_expert.", 2);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].name, "layers.2.shared_expert.gate_up");
  EXPECT_EQ(specs[0].shape, (Shape{2 * kWidth, kHidden}));
  EXPECT_EQ(specs[1].name, "layers.2.shared_expert.down");
  EXPECT_EQ(specs[1].shape, (Shape{kHidden, kWidth}));
  for (const ParamSpec& spec : specs) {
    EXPECT_EQ(spec.role, ParamRole::SharedExpert) << spec.name;
    EXPECT_EQ(spec.layer, 2) << spec.name;
  }
  const GatedMlpOptions mlp = SharedExpert::mlp_options(shared_options());
  EXPECT_EQ(mlp.num_experts, 0);
  EXPECT_EQ(mlp.hidden_size, kHidden);
  EXPECT_EQ(mlp.intermediate_size, kWidth);
}

// The shared expert in one store and a dense GatedMlp (role Dense) in another, with the same weights: the same
// bytes out, in, and in every weight gradient.
TEST(SharedExpertBlock, ForwardAndBackwardAreBitwiseADenseGatedMlpsOnTheSameWeights) {
  ParameterStore shared_store(with_whole_pieces(SharedExpert::param_specs(shared_options(), "se.", 0)));
  fill_random(shared_store, 51, 0.3);
  GatedMlpOptions dense_options;
  dense_options.hidden_size = kHidden;
  dense_options.intermediate_size = kWidth;
  ParameterStore dense_store(with_whole_pieces(GatedMlp::param_specs(dense_options, "mlp.", 0)));
  dense_store.param("mlp.gate_up").copy_from(shared_store.param("se.gate_up"));
  dense_store.param("mlp.down").copy_from(shared_store.param("se.down"));
  Rng rng(52);
  const Tensor x = random_tensor({6, kHidden}, DType::F32, rng), d_y = random_tensor({6, kHidden}, DType::F32, rng);

  const SharedExpert shared(shared_options(), shared_store, "se.");
  MlpRecord shared_record;
  const Tensor shared_y = shared.forward(shared_record, x);
  const Tensor shared_dx = shared.backward_input(shared_record, d_y);
  shared.backward_weight(shared_record);

  const GatedMlp dense(dense_options, dense_store, "mlp.");
  MlpRecord dense_record;
  const Tensor dense_y = dense.forward(dense_record, x, Tensor());
  const Tensor dense_dx = dense.backward_input(dense_record, d_y);
  dense.backward_weight(dense_record);

  EXPECT_EQ(values(shared_y), values(dense_y));
  EXPECT_EQ(values(shared_dx), values(dense_dx));
  EXPECT_EQ(values(shared_store.grad("se.gate_up")), values(dense_store.grad("mlp.gate_up")));
  EXPECT_EQ(values(shared_store.grad("se.down")), values(dense_store.grad("mlp.down")));
  // Not trivially equal: the gradients are there.
  EXPECT_GT(testing::dot(shared_store.grad("se.down"), shared_store.grad("se.down")), 0.0);
}

TEST(SharedExpertBlockOptions, RefusesTheSigmoidGateByName) {
  SharedExpertOptions o = shared_options();
  o.sigmoid_gate = true;
  std::string m = error_message([&] { SharedExpert::param_specs(o, "se.", 0); });
  EXPECT_TRUE(contains(m, "shared expert: the sigmoid gate")) << m;
  ParameterStore store(with_whole_pieces(SharedExpert::param_specs(shared_options(), "se.", 0)));
  m = error_message([&] { SharedExpert shared(o, store, "se."); });
  EXPECT_TRUE(contains(m, "shared expert: the sigmoid gate")) << m;
}

}  // namespace
}  // namespace moetrain::model
