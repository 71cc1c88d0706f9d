// defines: the learning-rate schedule: linear warmup from lr/warmup to lr, then constant, cosine,
// linear or WSD (warmup-stable-decay) down to min_lr_ratio * lr at the last step.
#pragma once

#include <cstdint>

#include "io/job_config.h"

namespace moetrain::train {

class LrSchedule {
 public:
  LrSchedule(const io::OptimSection& optim, int64_t total_steps);
  // Learning rate of step `step` (0-based).
  double at(int64_t step) const;

 private:
  io::OptimSection optim_;
  int64_t total_steps_;
};

}  // namespace moetrain::train
