// defines: the CUDA kernels of the optimizer ops (ops/optim.h): the AdamW update on f32 tensors, bit for bit the
// CPU reference's, and deterministic sums of squares (a fixed tree in f64) that come back to the host.
#pragma once

#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/optim.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::adamw_step: contiguous f32 tensors of one shape on the stream's device. Every step
// of ops/cpu/optim.cpp is one f32 operation rounded to nearest (no fused multiply-add), with the same scalars
// rounded from the same doubles, so the result is the CPU's bit for bit.
void adamw_step(const Stream& stream, const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& grad, const AdamWParams& params);

// Sum of x^2 over a contiguous f32 tensor, in f64: per chunk of kSumOfSquaresChunk elements a fixed tree, then a
// fixed tree over the chunks, so the result depends on the values and the element count alone. Synchronises the
// stream to return the host value.
double sum_of_squares(const Stream& stream, const Tensor& x);
// The sums of squares of several tensors (each as sum_of_squares), with one copy to the host and one
// synchronisation for the whole list (global norm, clipping).
std::vector<double> sums_of_squares(const Stream& stream, const std::vector<Tensor>& tensors);

constexpr int64_t kSumOfSquaresChunk = 4096;

}  // namespace moetrain::ops::cuda
