// defines: the CUDA kernels of the elementwise ops (ops/elementwise.h): residual add, accumulate, scale, casts
// between f64 / f32 / bf16 and in-place bf16 rounding. One independent output per element, so every result is the
// same whatever the launch size.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by the ops:: functions: contiguous, on the stream's device, same shape and dtype, f32 or
// bf16 for the arithmetic ones (bf16 computes in f32 and rounds the result to nearest even). Outputs may alias
// inputs.
void add_forward(const Stream& stream, const Tensor& out, const Tensor& a, const Tensor& b);
void accumulate(const Stream& stream, const Tensor& acc, const Tensor& x);
void scale_inplace(const Stream& stream, const Tensor& x, double factor);  // factor rounded to f32 first
// f64 / f32 / bf16 in any direction with the rules of core/dtype.h and ops/cpu/elementwise.h, bit for bit: f32 ->
// bf16 rounds to nearest even and keeps NaN a quiet NaN; f64 -> bf16 goes through f32.
void cast(const Stream& stream, const Tensor& out, const Tensor& in);
void round_to_bf16_inplace(const Stream& stream, const Tensor& x);  // f32

}  // namespace moetrain::ops::cuda
