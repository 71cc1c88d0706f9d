// defines: the CPU reference of the elementwise ops (ops/elementwise.h): one independent output per element, so
// the loops run in parallel and every result is the same whatever the thread count.
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of ops/elementwise.h: contiguous, same shape and dtype
// (f32 or f64 for the arithmetic ones). Each element is read before it is written, so outputs may alias inputs.
void add_forward(const Tensor& out, const Tensor& a, const Tensor& b);
void accumulate(const Tensor& acc, const Tensor& x);
void scale_inplace(const Tensor& x, double factor);  // factor is rounded to the tensor's dtype first
// f64 / f32 / bf16 in any direction: widening is exact; f64 -> f32 rounds to nearest; f32 -> bf16 rounds to
// nearest even (core/dtype.h); f64 -> bf16 goes through f32 as Tensor::to does.
void cast(const Tensor& out, const Tensor& in);
void round_to_bf16_inplace(const Tensor& x);  // f32

}  // namespace moetrain::ops::cpu
