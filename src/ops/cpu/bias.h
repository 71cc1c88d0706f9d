// defines: the CPU reference of the bias ops (ops/bias.h): bias added to every row or per group of rows, and the bias
// gradients as column sums over ascending rows, one thread per block of columns (never a sum split across threads).
#pragma once

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// The arguments are validated by the ops:: functions of the same name: y / dy f32 or f64, bias f32 or y's dtype,
// dbias dy's dtype, offsets i32 [G + 1] non-decreasing from 0 to R.
void bias_add(const Tensor& y, const Tensor& bias);
// dbias[n] += (dy[0, n] + dy[1, n] + ...) in dy's dtype; nothing is added when R = 0.
void bias_backward(const Tensor& dbias, const Tensor& dy);
void grouped_bias_add(const Tensor& y, const Tensor& bias, const Tensor& offsets);
// Per group as bias_backward over the group's rows; an empty group adds nothing.
void grouped_bias_backward(const Tensor& dbias, const Tensor& dy, const Tensor& offsets);

}  // namespace moetrain::ops::cpu
