// defines: the exact lanes of a job (docs/design.md section 6, docs/exact_lanes.md): the admission contract declared
// for the job's model, device, losses and partition, and the checks every scheduled forward of a pipeline runs on its
// wire. `train` and `score` both use them, so that exact.enabled means the same program in either.
#pragma once

#include "exact/admission.h"
#include "io/job_config.h"
#include "model/causal_lm.h"
#include "pipeline/dualpipev_executor.h"
#include "pipeline/partition.h"

namespace moetrain::train {

// The layer partition over `pp` ranks (the mesh's; parallel.pp in a job file): balanced by cost, or parallel.pp_cuts.
pipeline::Partition job_partition(const io::JobConfig& config, const model::ModelConfig& model_config, int pp);

// The exact-lane admission of a job for `model`: on the CPU the exact program is declared as bf16 compute with
// uniformly fp32 masters, a bf16 wire, the parameter dtypes of the store, the job's losses and device, and the
// partition the job runs; `ep_size`, the run's expert-parallel degree, resolves loss.device_balance_groups = 0.
// Throws listing every violation; logs one line per stage on success.
exact::AdmissionReport admit_exact_for_job(const io::JobConfig& config, const model::CausalLm& model,
                                           const pipeline::Partition& partition, int64_t ep_size);

// The wire check of a pipeline stage on pp rank `stage` in exact mode: every activation sent or received is a bf16
// [T, H] tensor (T from the micro-batch's position_ids) and its micro-batch's varlen metadata is valid with the
// declared max length `max_seqlen`. Micro-batches are named by -1 (the wire does not carry their index).
pipeline::WireCheck exact_wire_check(int stage, int64_t hidden, int64_t max_seqlen);

}  // namespace moetrain::train
