// defines: the shared test helpers of test_data.h.
#include "testing/test_data.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <system_error>

#include <gtest/gtest.h>
#include <unistd.h>

namespace moetrain::testing {

namespace {

double element(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::F64) return t.data<double>()[i];
  if (t.dtype() == DType::F32) return t.data<float>()[i];
  ADD_FAILURE() << "testing: expected an f32 or f64 tensor but found " << t.describe();
  return 0.0;
}

void set_element(Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::F64) {
    t.data<double>()[i] = v;
  } else {
    t.data<float>()[i] = static_cast<float>(v);
  }
}

// The folders make_temp_dir made in this process.
struct TempDirs {
  std::mutex mutex;
  std::vector<std::filesystem::path> paths;
};

TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}

// Removes the process's temporary folders once its tests are done (a folder can outlive the test that made it: a
// fixture cached for the binary's other tests), unless a test failed: then they stay, to look into, and their place
// is printed. Without it every run of the suites left a few hundred folders in the temp folder.
class TempDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    TempDirs& dirs = temp_dirs();
    const std::lock_guard lock(dirs.mutex);
    if (dirs.paths.empty()) return;
    if (::testing::UnitTest::GetInstance()->Failed()) {
      std::fprintf(stderr, "testing: a test failed, so its %zu temporary folder(s) are kept under %s\n",
                   dirs.paths.size(), dirs.paths.front().parent_path().string().c_str());
      return;
    }
    for (const std::filesystem::path& path : dirs.paths) {
      std::error_code ignored;  // a folder a test removed itself is fine
      std::filesystem::remove_all(path, ignored);
    }
    dirs.paths.clear();
  }
};

[[maybe_unused]] ::testing::Environment* const temp_dir_cleanup =
    ::testing::AddGlobalTestEnvironment(new TempDirCleanup);  // gtest owns it

}  // namespace

std::string test_data_path(const std::string& relative) {
  // MOETRAIN_TEST_DATA overrides the compiled-in source path, for test binaries built on one
  // machine and run from another checkout (the GPU machine).
  const char* override_dir = std::getenv("MOETRAIN_TEST_DATA");
  return std::string(override_dir != nullptr ? override_dir : MOETRAIN_TEST_DATA_DIR) + "/" + relative;
}

std::string repo_path(const std::string& relative) {
  // Normal form, since tests write these paths into job files and compare them with what the engine reports.
  return std::filesystem::path(test_data_path("../../" + relative)).lexically_normal().string();
}

std::string make_temp_dir(const std::string& tag) {
  static std::atomic<int> counter{0};
  const auto path = std::filesystem::temp_directory_path() /
                    ("moetrain_test_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  TempDirs& dirs = temp_dirs();
  const std::lock_guard lock(dirs.mutex);
  dirs.paths.push_back(path);
  return path.string();
}

std::vector<int32_t> random_group_offsets(int64_t groups, int64_t rows, Rng& rng, int64_t skip) {
  std::vector<int32_t> offsets(static_cast<size_t>(groups + 1), 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t g = static_cast<int64_t>(rng.below(static_cast<uint64_t>(groups)));
    if (g == skip) g = (g + 1) % groups;
    ++offsets[static_cast<size_t>(g + 1)];
  }
  for (int64_t g = 0; g < groups; ++g) offsets[static_cast<size_t>(g + 1)] += offsets[static_cast<size_t>(g)];
  return offsets;
}

Tensor random_tensor(const Shape& shape, DType dtype, Rng& rng, double scale) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) set_element(t, i, rng.normal() * scale);
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double s = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) s += element(a, i) * element(b, i);
  return s;
}

double relative_error(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel()) << a.describe() << " vs " << b.describe();
  double diff = 0.0, ref = 0.0;
  for (int64_t i = 0; i < std::min(a.numel(), b.numel()); ++i) {
    const double d = element(a, i) - element(b, i);
    diff += d * d;
    ref += element(b, i) * element(b, i);
  }
  if (ref == 0.0) return diff == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(diff / ref);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0.0;
  for (int64_t i = 0; i < std::min(a.numel(), b.numel()); ++i)
    m = std::max(m, std::fabs(element(a, i) - element(b, i)));
  return m;
}

void expect_gradients_match(const std::function<double()>& loss, std::vector<GradientInput> inputs, double step,
                            double tolerance) {
  for (auto& input : inputs) {
    ASSERT_EQ(input.value.dtype(), DType::F64) << input.name << ": finite differences need f64 inputs";
    ASSERT_EQ(input.value.shape(), input.analytic.shape()) << input.name;
    Tensor numeric = Tensor::zeros(input.value.shape(), DType::F64);
    for (int64_t i = 0; i < input.value.numel(); ++i) {
      const double original = element(input.value, i);
      set_element(input.value, i, original + step);
      const double plus = loss();
      set_element(input.value, i, original - step);
      const double minus = loss();
      set_element(input.value, i, original);
      numeric.data<double>()[i] = (plus - minus) / (2.0 * step);
    }
    const Tensor analytic = input.analytic.dtype() == DType::F64 ? input.analytic : input.analytic.to(DType::F64);
    const double error = relative_error(analytic, numeric);
    EXPECT_LT(error, tolerance) << "gradient of " << input.name << ": relative error " << error
                                << " against central differences";
  }
}

}  // namespace moetrain::testing
