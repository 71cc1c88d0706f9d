// defines: the CUDA kernels of the row gather and segmented row sums (ops/row_gather.h).
#pragma once

#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// Arguments validated by ops::gather_rows / ops::sum_rows: contiguous, on the stream's device, matrices [rows, H],
// i32 index vectors. Index VALUES are not checked on the host (they live on the device; the caller checks them where
// it builds them). As a guard, a bad value never touches memory outside the tensors: gather_rows fills the row of an
// index outside [0, M) with 0xff bytes (NaN for the float dtypes), sum_rows writes NaN into a segment whose bounds
// are not inside [0, S] in order or which lists a row outside [0, N).
//
// out [N, H] = in[index]: a copy of the rows' bytes (any dtype; the widest word up to 16 bytes that divides the row).
void gather_rows(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& index);
// out [U, H] (f32 or bf16, in's dtype) = per segment, its rows of `in` summed in f32 in ascending order starting
// from the first row (the CPU reference's order: f32 results match it bit for bit); an empty segment writes 0.
void sum_rows(const Stream& stream, const Tensor& out, const Tensor& in, const Tensor& segment_offsets,
              const Tensor& segment_rows);
// Arguments validated by ops::count_tokens_per_rank (ranks <= 64). Integer atomics: the counts are exact.
void count_tokens_per_rank(const Stream& stream, const Tensor& counts, const Tensor& topk_index,
                           int64_t experts_per_rank);

// Arguments validated by ops::concat_group_offsets / ops::concat_group_rows (at most kMaxGroupParts parts; offsets'
// values unchecked: a row whose computed place falls outside out is not written).
void concat_group_offsets(const Stream& stream, const Tensor& out_offsets, const std::vector<Tensor>& offsets);
void concat_group_rows(const Stream& stream, const Tensor& out, const std::vector<Tensor>& parts,
                       const std::vector<Tensor>& offsets);

}  // namespace moetrain::ops::cuda
