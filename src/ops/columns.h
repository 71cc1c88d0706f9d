// defines: column-block moves between tensors seen as matrices [rows, columns] (the last dimension is the columns):
// a copy of `width` columns with each source row optionally repeated over consecutive destination rows, and the sum
// that is its backward. Latent attention assembles its per-head queries and keys from pieces this way (the shared
// rotary key broadcast over the heads) and splits the expanded keys and values. Deterministic on every backend.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// dst[r, dst_col + j] = src[r / repeat, src_col + j] for every row r of dst and j in [0, width). dst and src are
// contiguous, of one dtype (any), with rows(dst) = rows(src) * repeat; the other columns of dst are left as they
// are. A plain copy: bitwise on every backend.
void copy_columns(Stream& stream, Tensor dst, int64_t dst_col, const Tensor& src, int64_t src_col, int64_t width,
                  int64_t repeat = 1);

// The backward of a repeated copy: dst[r, dst_col + j] = sum over i in [0, repeat) ascending of
// src[r * repeat + i, src_col + j] (overwritten); rows(src) = rows(dst) * repeat. Float dtypes: f32 or f64 on the
// CPU, f32 or bf16 on CUDA, and bf16 on the CPU; bf16 sums in f32 and rounds once, so f32 and bf16 results are
// bitwise equal on the CPU and CUDA.
void sum_repeated_columns(Stream& stream, Tensor dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                          int64_t width, int64_t repeat);

}  // namespace moetrain::ops
