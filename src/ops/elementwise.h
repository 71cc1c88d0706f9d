// defines: elementwise ops the blocks share: residual add, in-place accumulate and scale, casts.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// out = a + b (out may alias a, or b of its dtype). One shape; out and a of one float dtype; b in it too on the CPU,
// in f32 or bf16 on CUDA (a bf16 activation added into an f32 residual stream), the sum rounded once to out's dtype.
void add_forward(Stream& stream, Tensor out, const Tensor& a, const Tensor& b);
// acc += x, with x typed as add_forward's b.
void accumulate(Stream& stream, Tensor acc, const Tensor& x);
// x *= factor
void scale_inplace(Stream& stream, Tensor x, double factor);
// out = in converted to out's dtype (f64, f32, bf16), element by element with the rules of dtype.h.
void cast(Stream& stream, Tensor out, const Tensor& in);
// `in` itself when it is in `dtype` already, else a new tensor holding cast(in) (e.g. an f32 gradient entering a bf16
// GEMM's backward).
Tensor in_dtype(Stream& stream, const Tensor& in, DType dtype);
// Rounds every element of an f32 tensor to the nearest bf16 value, in place (the exact lanes'
// layer-boundary rounding).
void round_to_bf16_inplace(Stream& stream, Tensor x);

}  // namespace moetrain::ops
