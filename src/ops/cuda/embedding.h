// defines: the CUDA kernels of the embedding ops (ops/embedding.h): the row gather and a deterministic weight
// gradient (tokens grouped by id with a stable radix sort, each id's tokens summed in ascending order).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::embedding_*: contiguous, on the stream's device, ids i32 [T], table / dtable [V, H]
// with V < 2^31 - 1. The id range is NOT checked: that needs the values on the host, which an op on the device
// never reads (the trainer validates every batch on the host before it is copied). As a guard, an id outside
// [0, V) never touches memory outside the table: the forward writes a NaN row for it and the backward skips it.
//
// y [T, H] = table[ids]; table and y each f32 or bf16 (a bf16 y rounds to nearest even).
void embedding_forward(const Stream& stream, const Tensor& y, const Tensor& ids, const Tensor& table);
// dtable f32 [V, H] += per id, the sum of its tokens' dy rows (f32 or bf16) in ascending token order, the CPU's
// order: with f32 dy the result is the CPU's bit for bit.
void embedding_backward_weight(const Stream& stream, const Tensor& dtable, const Tensor& dy, const Tensor& ids);

}  // namespace moetrain::ops::cuda
