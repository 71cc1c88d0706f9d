// defines: the CUDA kernels of the bias ops (ops/bias.h): the bias added per element (per row's group for the grouped
// form), and the bias gradients as a fixed two-pass column reduction: ascending sums over chunks of
// kBiasRowsPerChunk rows of a group, then each group's chunk sums in ascending order.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by the ops:: functions of the same name: contiguous, on the stream's device, y / dy [R, N] f32
// or bf16 (computed in f32), bias f32 or y's dtype, dbias f32, offsets i32 [G + 1]. The offsets' values are not read
// on the host: the kernels clamp them into [0, R], so malformed ones give wrong results, never accesses out of
// bounds.
// y = y + bias, one f32 add rounded to y's dtype: the CPU reference's bits on the same (rounded) values.
void bias_add(const Stream& stream, const Tensor& y, const Tensor& bias);
// A group's (here: all rows') sum depends on its row count alone: chunks start at the group's first row.
void bias_backward(const Stream& stream, const Tensor& dbias, const Tensor& dy);
void grouped_bias_add(const Stream& stream, const Tensor& y, const Tensor& bias, const Tensor& offsets);
// An empty group adds nothing (its dbias row keeps its bits).
void grouped_bias_backward(const Stream& stream, const Tensor& dbias, const Tensor& dy, const Tensor& offsets);

constexpr int64_t kBiasRowsPerChunk = 128;

}  // namespace moetrain::ops::cuda
