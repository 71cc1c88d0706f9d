// defines: the CUDA column-block moves (ops/columns.h); arguments validated there.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

void copy_columns(const Stream& stream, const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                  int64_t width, int64_t repeat);
void sum_repeated_columns(const Stream& stream, const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                          int64_t width, int64_t repeat);

}  // namespace moetrain::ops::cuda
