// defines: job_model, the model a job runs, built in one place for `train` and `score` alike: its config, device,
// compute dtype and head (model.head_chunk), so the two commands run the same program.
#pragma once

#include <memory>

#include "io/job_config.h"
#include "model/causal_lm.h"

namespace moetrain::train {

// Zero parameters of the job's model on its device (CUDA set up first), with the job's head chunk. The weights are
// the caller's to fill (random init, HF weights or a checkpoint).
std::unique_ptr<model::CausalLm> job_model(const io::JobConfig& config);

}  // namespace moetrain::train
