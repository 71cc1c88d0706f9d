// Tests for testing::test_data_path and testing::repo_path (tests/testing/test_data.h): test binaries carried to the
// GPU machine run from another checkout, so every fixture path must follow $MOETRAIN_TEST_DATA when it is set.
#include "testing/test_data.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

namespace moetrain {
namespace {

// Sets $MOETRAIN_TEST_DATA for one scope and puts back what was there.
class TestDataOverride {
 public:
  explicit TestDataOverride(const std::string& dir) {
    if (const char* before = std::getenv("MOETRAIN_TEST_DATA")) before_ = before;
    setenv("MOETRAIN_TEST_DATA", dir.c_str(), 1);
  }
  ~TestDataOverride() {
    if (before_) {
      setenv("MOETRAIN_TEST_DATA", before_->c_str(), 1);
    } else {
      unsetenv("MOETRAIN_TEST_DATA");
    }
  }
  TestDataOverride(const TestDataOverride&) = delete;
  TestDataOverride& operator=(const TestDataOverride&) = delete;

 private:
  std::optional<std::string> before_;
};

TEST(TestData, EveryPathFollowsTheOverride) {
  const TestDataOverride override_dir("/elsewhere/checkout/tests/data");
  EXPECT_EQ(testing::test_data_path("golden/qwen3/config.json"),
            "/elsewhere/checkout/tests/data/golden/qwen3/config.json");
  EXPECT_EQ(testing::repo_path("examples/tiny_moe/config.json"), "/elsewhere/checkout/examples/tiny_moe/config.json");
  EXPECT_EQ(testing::repo_path("scripts/check_tensorboard.py"), "/elsewhere/checkout/scripts/check_tensorboard.py");
}

TEST(TestData, RepoPathIsInNormalFormAndNamesAFileOfThisCheckout) {
  const std::string path = testing::repo_path("examples/tiny_moe/config.json");
  EXPECT_EQ(path.find(".."), std::string::npos) << path;
  EXPECT_EQ(path, testing::repo_path("examples/./tiny_moe/config.json"));
  EXPECT_TRUE(std::ifstream(path).good()) << path;
}

}  // namespace
}  // namespace moetrain
