// Tests for train/lr_schedule: warmup and the four decay shapes.
#include "train/lr_schedule.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace moetrain::train {
namespace {

io::OptimSection optim(const std::string& schedule) {
  io::OptimSection o;
  o.lr = 1.0;
  o.schedule = schedule;
  o.warmup_steps = 4;
  o.min_lr_ratio = 0.1;
  o.decay_fraction = 0.5;
  return o;
}

TEST(LrSchedule, WarmsUpLinearlyToThePeak) {
  const LrSchedule s(optim("constant"), 20);
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(19), 1.0);
}

TEST(LrSchedule, CosineEndsAtTheFloor) {
  const LrSchedule s(optim("cosine"), 21);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(12), 0.55, 1e-12);  // halfway: floor + (peak - floor) / 2
  EXPECT_NEAR(s.at(20), 0.1, 1e-12);
}

TEST(LrSchedule, LinearEndsAtTheFloor) {
  const LrSchedule s(optim("linear"), 21);
  EXPECT_NEAR(s.at(12), 0.55, 1e-12);
  EXPECT_NEAR(s.at(20), 0.1, 1e-12);
}

TEST(LrSchedule, WsdStaysThenDecays) {
  const LrSchedule s(optim("wsd"), 21);
  EXPECT_DOUBLE_EQ(s.at(12), 1.0);  // progress 0.5: end of the stable phase
  EXPECT_NEAR(s.at(16), 0.55, 1e-12);
  EXPECT_NEAR(s.at(20), 0.1, 1e-12);
}

TEST(LrSchedule, RejectsUnknownSchedule) { EXPECT_THROW(LrSchedule(optim("step"), 10), Error); }

}  // namespace
}  // namespace moetrain::train
