// defines: the CPU reference of the token embedding (ops/embedding.h): a row gather, and a weight gradient that
// walks each vocabulary row's tokens in ascending order in one thread.
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of ops/embedding.h: ids i32 [T] inside [0, V), table and
// dtable [V, H], y and dy [T, H], one float dtype (f32 or f64), contiguous.
void embedding_forward(const Tensor& y, const Tensor& ids, const Tensor& table);
// dtable[v, :] += (dy[t1, :] + dy[t2, :] + ...) for the tokens t1 < t2 < ... with ids[t] == v: the sum is formed
// first, in ascending token order, then added; rows run in parallel.
void embedding_backward_weight(const Tensor& dtable, const Tensor& dy, const Tensor& ids);

}  // namespace moetrain::ops::cpu
