// Tests for testing::expect_error (tests/testing/error_message.h), through which every refusal test reads its error:
// it must fail when nothing is thrown and when a phrase is missing, so that no refusal test passes vacuously.
#include "testing/error_message.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "core/error.h"

namespace moetrain {
namespace {

TEST(ExpectError, PassesWhenTheErrorNamesEveryPhrase) {
  testing::expect_error([] { MT_CHECK(false, "expected x [T, C] but found {}", "f32[3]"); }, {"x [T, C]", "f32[3]"});
  testing::expect_error([] { MT_CHECK(false, "token count {}", 6); }, "token count 6");
}

TEST(ExpectError, FailsWhenNothingIsThrown) {
  EXPECT_NONFATAL_FAILURE(testing::expect_error([] {}, "anything"), "expected a moetrain::Error mentioning 'anything'");
}

TEST(ExpectError, FailsWhenAPhraseIsMissing) {
  EXPECT_NONFATAL_FAILURE(testing::expect_error([] { MT_CHECK(false, "expected x in f32"); }, {"x in f32", "f64"}),
                          "lacks 'f64'");
}

}  // namespace
}  // namespace moetrain
