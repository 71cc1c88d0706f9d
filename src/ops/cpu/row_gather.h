// defines: the CPU reference of the row gather and segmented row sums (ops/row_gather.h): plain loops, output rows
// in parallel, every sum in one thread in ascending segment order.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace moetrain::ops::cpu {

// Arguments validated by ops::gather_rows: out [N, H] and in [M, H] of one dtype (any), index i32 [N] in [0, M),
// all contiguous on the CPU. A byte copy of each row.
void gather_rows(const Tensor& out, const Tensor& in, const Tensor& index);
// Arguments validated by ops::sum_rows: out [U, H] and in [N, H] of one dtype (f32, f64 or bf16; bf16 sums in
// f32), segment_offsets i32 [U + 1] non-decreasing from 0 to S, segment_rows i32 [S] in [0, N).
void sum_rows(const Tensor& out, const Tensor& in, const Tensor& segment_offsets, const Tensor& segment_rows);
// Arguments validated by ops::count_tokens_per_rank.
void count_tokens_per_rank(const Tensor& counts, const Tensor& topk_index, int64_t experts_per_rank);

// Arguments validated by ops::concat_group_offsets / ops::concat_group_rows (offsets' values included).
void concat_group_offsets(const Tensor& out_offsets, const std::vector<Tensor>& offsets);
void concat_group_rows(const Tensor& out, const std::vector<Tensor>& parts, const std::vector<Tensor>& offsets);

}  // namespace moetrain::ops::cpu
