// Tests for the shared expert block (model/blocks/shared_expert.*): its parameters are a dense gated MLP's with the
// shared-expert role, its forward, input gradient and weight gradients are bitwise a dense GatedMlp's on the same
// weights, and with the sigmoid gate they are bitwise the composition of that MLP with the gate's ops.
#include "model/blocks/shared_expert.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "model/blocks/block_testing.h"
#include "model/blocks/gated_mlp.h"
#include "ops/activation.h"
#include "ops/elementwise.h"
#include "ops/gemm.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

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
  SharedExpertRecord shared_record;
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

// The sigmoid gate (Qwen3.5): "<prefix>sigmoid_gate" [1, H] with the shared-expert role, and the passes bitwise the
// composition of a dense GatedMlp on the same weights with the gate's ops: logit = x g^T, out = y * sigmoid(logit);
// backward: the gate's backward, the MLP's on its y gradient, x's gradient summed MLP first, then the gate's.
TEST(SharedExpertBlock, SigmoidGateIsBitwiseItsComposition) {
  SharedExpertOptions o = shared_options();
  o.sigmoid_gate = true;
  const auto specs = SharedExpert::param_specs(o, "layers.1.shared_expert.", 1);
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_EQ(specs[2].name, "layers.1.shared_expert.sigmoid_gate");
  EXPECT_EQ(specs[2].shape, (Shape{1, kHidden}));
  EXPECT_EQ(specs[2].role, ParamRole::SharedExpert);

  ParameterStore shared_store(with_whole_pieces(SharedExpert::param_specs(o, "se.", 0)));
  fill_random(shared_store, 61, 0.3);
  GatedMlpOptions dense_options;
  dense_options.hidden_size = kHidden;
  dense_options.intermediate_size = kWidth;
  ParameterStore dense_store(with_whole_pieces(GatedMlp::param_specs(dense_options, "mlp.", 0)));
  dense_store.param("mlp.gate_up").copy_from(shared_store.param("se.gate_up"));
  dense_store.param("mlp.down").copy_from(shared_store.param("se.down"));
  const Tensor w_gate = shared_store.param("se.sigmoid_gate");
  Rng rng(62);
  const int64_t T = 7;
  const Tensor x = random_tensor({T, kHidden}, DType::F32, rng), d_out = random_tensor({T, kHidden}, DType::F32, rng);

  const SharedExpert shared(o, shared_store, "se.");
  SharedExpertRecord record;
  const Tensor out = shared.forward(record, x);
  const Tensor dx = shared.backward_input(record, d_out);
  shared.backward_weight(record);

  Stream& s = default_stream(Device::cpu());
  const GatedMlp dense(dense_options, dense_store, "mlp.");
  MlpRecord dense_record;
  const Tensor y = dense.forward(dense_record, x, Tensor());
  Tensor logit = Tensor::empty({T, 1}, DType::F32);
  ops::linear_forward(s, logit, x, w_gate);
  Tensor expected = Tensor::empty({T, kHidden}, DType::F32);
  ops::sigmoid_gate_forward(s, expected, y, logit);
  Tensor d_y = Tensor::empty({T, kHidden}, DType::F32), d_logit = Tensor::empty({T, 1}, DType::F32);
  ops::sigmoid_gate_backward(s, d_y, d_logit, d_out, y, logit);
  Tensor expected_dx = dense.backward_input(dense_record, d_y);
  dense.backward_weight(dense_record);
  Tensor partial = Tensor::empty({T, kHidden}, DType::F32);
  ops::linear_backward_input(s, partial, d_logit, w_gate);
  ops::accumulate(s, expected_dx, partial);
  Tensor expected_g_gate = Tensor::zeros({1, kHidden}, DType::F32);
  ops::linear_backward_weight(s, expected_g_gate, d_logit, x);

  EXPECT_EQ(values(out), values(expected));
  EXPECT_EQ(values(dx), values(expected_dx));
  EXPECT_EQ(values(shared_store.grad("se.gate_up")), values(dense_store.grad("mlp.gate_up")));
  EXPECT_EQ(values(shared_store.grad("se.down")), values(dense_store.grad("mlp.down")));
  EXPECT_EQ(values(shared_store.grad("se.sigmoid_gate")), values(expected_g_gate));
  EXPECT_GT(testing::dot(expected_g_gate, expected_g_gate), 0.0);
  EXPECT_NE(values(out), values(y));  // the gate scaled the output
}

}  // namespace
}  // namespace moetrain::model
