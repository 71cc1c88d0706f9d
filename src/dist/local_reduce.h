// defines: the in-process backend's reduction kernel: combines one contribution per rank in rank
// order (0, 1, ..., n-1), so the result's bits never depend on which thread arrived first.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "dist/communicator.h"

namespace moetrain::dist::detail {

// out[i] = parts[0][i] (op) parts[1][i] (op) ... for i in [0, count), left to right. bf16 is
// accumulated in f32 and rounded once at the end; the other types accumulate in themselves.
// `out` may alias none of `parts`. Supports f32, f64, bf16, i32, i64.
void reduce_in_rank_order(DType dtype, ReduceOp op, void* out, const std::vector<const void*>& parts, int64_t count);

}  // namespace moetrain::dist::detail
