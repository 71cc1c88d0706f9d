// Tests for ops/activation: SwiGLU forward against a direct computation, backward against finite differences,
// and argument checks.
#include "ops/activation.h"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "testing/test_data.h"

namespace moetrain::ops {
namespace {

using testing::random_tensor;

void expect_error_mentioning(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "expected a moetrain::Error mentioning \"" << text << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(Swiglu, ForwardMatchesDirectComputation) {
  const int64_t rows = 5, width = 7;
  Rng rng(30);
  const Tensor gate_up = random_tensor({rows, 2 * width}, DType::F32, rng, 3.0);
  Tensor y = Tensor::empty({rows, width}, DType::F32);
  swiglu_forward(Stream::cpu(), y, gate_up);

  const auto gu = gate_up.to_vector<float>();
  std::vector<double> want(static_cast<size_t>(rows * width));
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t j = 0; j < width; ++j) {
      const double g = gu[n * 2 * width + j], u = gu[n * 2 * width + width + j];
      want[n * width + j] = g / (1.0 + std::exp(-g)) * u;  // silu(gate) * up, gate first
    }
  }
  EXPECT_LT(testing::relative_error(y.to(DType::F64), Tensor::from_vector(want, {rows, width})), 1e-6);
}

TEST(Swiglu, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, width = 6;
  Rng rng(31);
  Tensor gate_up = random_tensor({rows, 2 * width}, DType::F64, rng, 2.0);
  const Tensor g = random_tensor({rows, width}, DType::F64, rng);
  Tensor y = Tensor::empty({rows, width}, DType::F64);
  auto loss = [&] {
    swiglu_forward(Stream::cpu(), y, gate_up);
    return testing::dot(y, g);
  };
  Tensor dgate_up = Tensor::empty({rows, 2 * width}, DType::F64);
  swiglu_backward(Stream::cpu(), dgate_up, g, gate_up);
  testing::expect_gradients_match(loss, {{"gate_up", gate_up, dgate_up}});
}

TEST(Swiglu, RejectsBadArguments) {
  Stream& s = Stream::cpu();
  const Tensor gate_up = Tensor::zeros({3, 8}, DType::F32);
  expect_error_mentioning(
      [&] {
        swiglu_forward(s, Tensor::zeros({3, 4}, DType::F32), Tensor::zeros({3, 7}, DType::F32));
      },
      "expected gate_up [N, 2I] with an even width but found f32[3, 7]");
  expect_error_mentioning(
      [&] {
        swiglu_forward(s, Tensor::zeros({3, 8}, DType::F32), gate_up);
      },
      "swiglu_forward: y [N, I]: expected shape [3, 4] but found [3, 8]");
  expect_error_mentioning(
      [&] {
        swiglu_forward(s, Tensor::zeros({3, 4}, DType::F64), gate_up);
      },
      "swiglu_forward: y [N, I]: expected dtype f32 but found f64");
  expect_error_mentioning([&] { swiglu_forward(s, Tensor::zeros({4}, DType::F32), Tensor::zeros({8}, DType::F32)); },
                          "expected gate_up [N, 2I]");
  expect_error_mentioning(
      [&] {
        swiglu_backward(s, Tensor::zeros({3, 8}, DType::F32), Tensor::zeros({2, 4}, DType::F32), gate_up);
      },
      "swiglu_backward: dy [N, I]: expected shape [3, 4] but found [2, 4]");
  expect_error_mentioning(
      [&] {
        swiglu_backward(s, Tensor::zeros({3, 4}, DType::F32), Tensor::zeros({3, 4}, DType::F32), gate_up);
      },
      "swiglu_backward: dgate_up [N, 2I]: expected shape [3, 8] but found [3, 4]");
}

}  // namespace
}  // namespace moetrain::ops
