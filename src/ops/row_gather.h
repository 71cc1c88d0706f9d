// defines: row gather and segmented row sums, the two data movements of the de-duplicated expert exchange
// (pipeline/expert_exchange.h): expand received unique token rows into expert-ordered copies, and sum the copies'
// gradients back into one row per unique token; and the concatenation of several expert-ordered row sets group by
// group (an expert bank's weight gradient over a whole step's micro-batches in one grouped GEMM). Deterministic on
// every backend (fixed summation order).
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace moetrain::ops {

// out [N, H] row i = in [M, H] row index[i]; index i32 [N], every entry in [0, M). A plain copy: out has in's
// dtype (any dtype) and the result is bitwise the input rows on every backend.
void gather_rows(Stream& stream, Tensor out, const Tensor& in, const Tensor& index);

// out [U, H] row u = sum over j in [segment_offsets[u], segment_offsets[u + 1]) ascending of in [N, H] row
// segment_rows[j]; an empty segment writes 0. segment_offsets i32 [U + 1] non-decreasing from 0 to S, segment_rows
// i32 [S] in [0, N) (rows may repeat or be left out). out and in share one float dtype: f32 or f64 on the CPU,
// f32 or bf16 on CUDA, plus bf16 on the CPU; bf16 sums in f32 and rounds once (nearest even). The sum starts from
// the segment's first row (a one-row segment copies its row bit for bit) and adds the others in order, so f32
// results are bitwise equal on the CPU and CUDA.
//
// Index values (index, segment_offsets, segment_rows) are validated when they are on the CPU. CUDA index tensors
// are not read by the host (an op never copies device memory back): the caller builds them on the host and checks
// them there (pipeline/expert_exchange.cpp does); as a guard, the CUDA kernels never touch memory outside the
// tensors for a bad index and write NaN into the rows it would have produced.
void sum_rows(Stream& stream, Tensor out, const Tensor& in, const Tensor& segment_offsets, const Tensor& segment_rows);

// counts i32 [ranks] (overwritten): for each rank q, how many tokens choose at least one expert of q, the experts
// being split into `ranks` consecutive blocks of `experts_per_rank` (expert e lives on rank e / experts_per_rank).
// topk_index i32 [T, K], entries in [0, ranks * experts_per_rank) (checked on the CPU; on CUDA an entry outside
// counts for no rank). The expert exchange sizes its de-duplicated dispatch with it before any host read. Integer
// counts: the same on every backend.
void count_tokens_per_rank(Stream& stream, Tensor counts, const Tensor& topk_index, int64_t experts_per_rank);

// Several expert-ordered row sets (parts: a step's micro-batches) as one expert-ordered set, so that one grouped GEMM
// covers them all: group g of the result holds part 0's rows of group g, then part 1's, ..., each part's rows in their
// order. offsets: one i32 [G + 1] per part (1 to kMaxGroupParts parts, the same G), non-decreasing from 0 to that
// part's row count.
constexpr int64_t kMaxGroupParts = 64;
// out_offsets i32 [G + 1] = the parts' offsets summed element by element: the result's group offsets.
void concat_group_offsets(Stream& stream, Tensor out_offsets, const std::vector<Tensor>& offsets);
// out [R_0 + R_1 + ..., H] from parts [R_p, H] (one dtype, any): part p's row r of group g goes to row
// out_offsets[g] + (the rows of group g in parts before p) + (r - offsets[p][g]). A copy of each row's bytes: the
// same bits on every backend. CUDA offsets are not read by the host (see above); a bad value never makes the kernel
// write outside out (the rows it would misplace are left as they were).
void concat_group_rows(Stream& stream, Tensor out, const std::vector<Tensor>& parts,
                       const std::vector<Tensor>& offsets);

}  // namespace moetrain::ops
