// Tests for `moetrain check-golden`: every case passes on the golden fixtures of qwen3 and
// qwen3_moe (the engine's fp32 CPU math against transformers 5.17), and bad arguments fail closed.
#include "cli/check_golden.h"

#include <gtest/gtest.h>

#include "cli/commands.h"
#include "core/error.h"
#include "testing/test_data.h"

namespace moetrain::cli {
namespace {

CheckGoldenOptions options_for(const std::string& family, const std::string& cases) {
  CheckGoldenOptions o;
  o.model_dir = testing::test_data_path("golden/" + family);
  o.reference = testing::test_data_path("golden/" + family + "/reference.safetensors");
  o.cases = cases;
  return o;
}

class CheckGoldenFamily : public ::testing::TestWithParam<const char*> {};

TEST_P(CheckGoldenFamily, BatchCaseMatchesTransformers) {
  EXPECT_EQ(run_check_golden(options_for(GetParam(), "batch")), 0);
}
TEST_P(CheckGoldenFamily, PackedCaseMatchesTransformers) {
  EXPECT_EQ(run_check_golden(options_for(GetParam(), "packed")), 0);
}
TEST_P(CheckGoldenFamily, TrajectoryCaseMatchesTransformers) {
  EXPECT_EQ(run_check_golden(options_for(GetParam(), "trajectory")), 0);
}

INSTANTIATE_TEST_SUITE_P(Golden, CheckGoldenFamily, ::testing::Values("qwen3", "qwen3_moe"));

TEST(CheckGolden, FailsWhenTheModelDoesNotMatchTheReference) {
  // qwen3_moe's reference against the qwen3 model: same shapes for the shared tensors, other math.
  CheckGoldenOptions o = options_for("qwen3", "batch");
  o.reference = testing::test_data_path("golden/qwen3_moe/reference.safetensors");
  EXPECT_EQ(run_check_golden(o), 1);
}

TEST(CheckGolden, RejectsAnUnknownDtypeAndBf16OnTheCpu) {
  CheckGoldenOptions o = options_for("qwen3", "batch");
  o.dtype = "f16";
  EXPECT_THROW(run_check_golden(o), Error);
  o.dtype = "bf16";  // the CPU reference computes in f32 only
  try {
    run_check_golden(o);
    ADD_FAILURE() << "bf16 on the CPU was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--dtype bf16 needs --device cuda"), std::string::npos) << e.what();
  }
}

TEST(CheckGolden, RejectsUnknownCase) { EXPECT_THROW(run_check_golden(options_for("qwen3", "everything")), Error); }

TEST(CheckGolden, CommandLineExitsNonZeroOnMissingModel) {
  const char* argv[] = {"moetrain", "check-golden", "--model", "/nonexistent/model", "--reference", "/nonexistent/ref"};
  EXPECT_EQ(run_main(6, const_cast<char**>(argv)), 1);
}

}  // namespace
}  // namespace moetrain::cli
