// defines: token embedding lookup and its weight gradient.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// y[t, :] = table[ids[t], :].  ids i32 [T], table [V, H], y [T, H]. An id outside [0, V) is an error.
void embedding_forward(Stream& stream, Tensor y, const Tensor& ids, const Tensor& table);
// dtable[v, :] += sum over t with ids[t] == v of dy[t, :] (tokens summed in ascending order).
void embedding_backward_weight(Stream& stream, Tensor dtable, const Tensor& dy, const Tensor& ids);

}  // namespace moetrain::ops
