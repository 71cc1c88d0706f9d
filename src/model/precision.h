// defines: the dtypes a block allocates besides its activations. Under bf16 compute the per-row
// statistics (RMSNorm's rstd, attention's and the loss's log-sum-exp) and the router's logits,
// probabilities and weights stay in f32: the kernels keep them in f32, and routing decisions and
// softmax normalisers lose too much in bf16.
#pragma once

#include "core/dtype.h"

namespace moetrain::model {

inline DType statistics_dtype(DType activations) { return activations == DType::BF16 ? DType::F32 : activations; }

}  // namespace moetrain::model
