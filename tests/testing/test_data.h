// defines: shared helpers for the test suites: where fixtures live, random tensors, relative
// error, and the finite-difference gradient check every op's backward is held to.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain::testing {

// tests/data in the source tree (fixtures copied from ../shared/golden and made by the project),
// or $MOETRAIN_TEST_DATA when set.
std::string test_data_path(const std::string& relative);
// A path below the repository's root (examples/, scripts/), in normal form, found from the same place as
// test_data_path, so binaries run from another checkout with $MOETRAIN_TEST_DATA set read that checkout's files.
std::string repo_path(const std::string& relative);
// A fresh empty directory under the system temp folder, unique per call. Removed with the others the process made
// when its tests end, unless one of them failed.
std::string make_temp_dir(const std::string& tag);

// Values drawn from N(0, scale^2), as f32 or f64 on the CPU.
Tensor random_tensor(const Shape& shape, DType dtype, Rng& rng, double scale = 1.0);
// Group offsets i32 values [groups + 1] of `rows` rows each assigned a random group (so some groups are empty), except
// group `skip` (>= 0), which gets none: the expert order the expert banks' ops read.
std::vector<int32_t> random_group_offsets(int64_t groups, int64_t rows, Rng& rng, int64_t skip = -1);
// sum_i a_i * b_i in f64 (any float dtype).
double dot(const Tensor& a, const Tensor& b);
// ||a - b|| / ||b|| (0 when both are zero).
double relative_error(const Tensor& a, const Tensor& b);
double max_abs_diff(const Tensor& a, const Tensor& b);

struct GradientInput {
  std::string name;
  Tensor value;     // f64; perturbed in place by the check, restored after
  Tensor analytic;  // the gradient the op's backward produced for `value`
};

// Compares each analytic gradient with central differences of `loss` (a scalar function of the
// current input values) and fails the test when the relative error of a tensor exceeds
// `tolerance`. In f64 with step 1e-6, truncation (~step^2) and rounding (~1e-16/step) errors are
// both far below the default tolerance of 1e-6, so a failure is a wrong derivative.
void expect_gradients_match(const std::function<double()>& loss, std::vector<GradientInput> inputs, double step = 1e-6,
                            double tolerance = 1e-6);

}  // namespace moetrain::testing
