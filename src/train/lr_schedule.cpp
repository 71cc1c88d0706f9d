// defines: the learning-rate schedules.
#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace moetrain::train {

LrSchedule::LrSchedule(const io::OptimSection& optim, int64_t total_steps) : optim_(optim), total_steps_(total_steps) {
  MT_CHECK(total_steps > 0, "lr schedule: expected train.steps > 0 but found {}", total_steps);
  MT_CHECK(optim.schedule == "constant" || optim.schedule == "cosine" || optim.schedule == "linear" ||
               optim.schedule == "wsd",
           "optim.schedule: expected constant, cosine, linear or wsd but found '{}'", optim.schedule);
}

double LrSchedule::at(int64_t step) const {
  const double peak = optim_.lr;
  const double floor = optim_.lr * optim_.min_lr_ratio;
  const int64_t warmup = optim_.warmup_steps;
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (optim_.schedule == "constant") return peak;
  const int64_t decay_steps = std::max<int64_t>(total_steps_ - warmup - 1, 1);
  const double progress = std::clamp(static_cast<double>(step - warmup) / static_cast<double>(decay_steps), 0.0, 1.0);
  if (optim_.schedule == "cosine") return floor + (peak - floor) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  if (optim_.schedule == "linear") return peak + (floor - peak) * progress;
  // wsd: stable at the peak, then a linear decay over the last decay_fraction of the steps.
  const double stable_end = 1.0 - optim_.decay_fraction;
  if (progress <= stable_end) return peak;
  return peak + (floor - peak) * (progress - stable_end) / optim_.decay_fraction;
}

}  // namespace moetrain::train
