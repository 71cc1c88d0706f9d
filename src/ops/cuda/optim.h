// defines: the CUDA kernels of the optimizer ops (ops/optim.h): the AdamW update on f32 tensors, bit for bit the
// CPU reference's, and deterministic sums of squares (a fixed tree in f64) that come back to the host.
#pragma once

#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "ops/optim.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::adamw_step: contiguous f32 tensors of one shape on the stream's device (the two moments
// may be bf16, ops/optim.h). Every step of ops/cpu/optim.cpp is one f32 operation rounded to nearest (no fused
// multiply-add), with the same scalars rounded from the same doubles, so the result is the CPU's bit for bit.
void adamw_step(const Stream& stream, const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& grad, const AdamWParams& params);

// AdamW over many tensors in ONE launch (arguments validated by ops::adamw_step_multi: contiguous f32 params, moments
// (all f32 or all bf16) and grads of matching shapes on the stream's device, distinct params, weight_decay[i] >= 0).
// compute_copies is empty or has one entry per param: undefined for none, else a bf16 or f32 tensor of the param's
// shape that gets the updated value (bf16: core/dtype.cpp's rounding, the bytes ops::cast writes). Every element runs
// adamw_step's code with the scalars of tensor i (its decay 1 - lr * wd[i] formed in double on the device with the same
// two roundings as the host), so the results are adamw_step's bit for bit. The tensors are listed in a device table
// that is cut into chunks of kAdamWMultiChunk elements (one block per chunk, a block finds its tensor by binary
// search); the table is built on the first call for a list (pointers, sizes, decays, copies, stream) and reused while
// the same list comes back (a few lists are kept), so a training step uploads nothing.
void adamw_step_multi(const Stream& stream, const std::vector<Tensor>& params, const std::vector<Tensor>& exp_avg,
                      const std::vector<Tensor>& exp_avg_sq, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& compute_copies, const std::vector<double>& weight_decay,
                      const AdamWParams& hyper);
// How many device tables adamw_step_multi has built in this process (tests: a repeated list reuses its table).
int64_t adamw_multi_tables_built();

constexpr int64_t kAdamWMultiChunk = 8192;

// Sum of x^2 over a contiguous f32 tensor, in f64: per chunk of kSumOfSquaresChunk elements a fixed tree, then a
// fixed tree over the chunks, so the result depends on the values and the element count alone. Synchronises the
// stream to return the host value.
double sum_of_squares(const Stream& stream, const Tensor& x);
// The sums of squares of several tensors (each as sum_of_squares), with one copy to the host and one
// synchronisation for the whole list (global norm, clipping).
std::vector<double> sums_of_squares(const Stream& stream, const std::vector<Tensor>& tensors);

constexpr int64_t kSumOfSquaresChunk = 4096;

}  // namespace moetrain::ops::cuda
