// defines: the Hopper tensor-core path of the grouped expert GEMMs (ops/grouped_gemm.h) on CUTLASS's ptr-array grouped
// kernels (wgmma + TMA, sm_90a): bf16 operands, f32 accumulation. The per-group problem sizes, pointers and strides
// are built on the device from the device offsets (no host copy, no synchronisation).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

// N and K must be positive multiples of this (8 bf16 = 16 bytes, TMA's row alignment), and every tensor's data must
// start on a 16-byte boundary, so that each group's first row (x + offsets[g] * K, ...) is 16-byte aligned.
inline constexpr int64_t kCutlassGroupedAlignment = 8;

// Whether the CUTLASS kernels take these operands: activation dtype bf16, w / dw [G, N, K] with N and K positive
// multiples of kCutlassGroupedAlignment, row counts and N, K within int32, and 16-byte aligned data for every tensor
// in `tensors`. The public ops route such calls here and keep the generic kernels (ops/cuda/grouped_gemm.h) for the
// rest (f32, unaligned shapes).
bool cutlass_grouped_gemm_supported(DType activations, int64_t rows, int64_t n_out, int64_t n_in,
                                    std::initializer_list<const Tensor*> tensors);

// Arguments as for the ops:: functions of the same name, already validated, and cutlass_grouped_gemm_supported.
// offsets i32 [G + 1] on the device; their values are clamped into [0, R] on the device (bad offsets give wrong
// results, never out-of-bounds accesses). Each output tile is computed by one CTA in a fixed order along the reduction
// (no split-K, no atomics), so results are deterministic and a group's rows do not depend on the other groups.
// The kernel schedule (ops/cuda/cutlass_grouped.cuh): cooperative (128 x 256 tiles, both warp groups on one tile) or
// ping-pong (a 64 x 256 tile per warp group, one group's epilogue beside the other's multiplications). Both give the
// same bytes (the same wgmma over the same k-blocks in the same order per output element);
// CudaGroupedGemmBench.DISABLED_ExpertShapes times them.
enum class GroupedGemmSchedule { Cooperative, Pingpong };
// The schedule of the ops over routed rows (forward, backward input) that the public ops run: cooperative, on single
// CTAs (kRoutedRowsCluster). Ping-pong's 64-row tiles pad a group half as much, and beat cooperative tiles in pairs
// along M by 6-14% (docs/gpu_notes.md, sixteenth session); but on single CTAs, which pad no group beyond its own
// tiles, the cooperative tiles are the faster: 14-18% below ping-pong pairs along M on DeepSeek-V2-Lite's routed
// expert shapes, 8% on the workload's (H100), where ping-pong tiles on single CTAs ask ~1.7 times their L2 bandwidth
// and are slower still (docs/gpu_notes.md, thirty-sixth session). That gain is the H100's: on an H200 the two run
// alike in the workload's and DeepSeek-V2-Lite's steps (thirty-seventh session), so this choice costs nothing there.
inline constexpr GroupedGemmSchedule kRoutedRowsSchedule = GroupedGemmSchedule::Cooperative;

// The thread-block cluster of the ops over routed rows (ops/cuda/cutlass_grouped.cuh): pairs of CTAs along M share a
// weight tile, pairs along N share a row tile, a single CTA shares nothing. CUTLASS's grouped scheduler pads each
// group's row tiles to a multiple of the cluster's M extent, so pairs along M pad a group's rows to two tiles (256
// rows on cooperative tiles): with routed groups that is a quarter more tiles than the rows need where one CTA pads
// them by an eighth. Pairs along N would pad N to two 256-wide tiles instead, so an output of an odd number of tiles
// runs on a single CTA when pairs along N are asked for. The bytes are the same for every cluster (the same wgmma
// over the same k-blocks per output element); CudaGroupedGemmBench.DISABLED_ExpertShapes times them. The weight
// gradient, whose M is the weight's N, keeps pairs along M.
enum class GroupedGemmCluster { PairAlongM, Single, PairAlongN };
inline constexpr GroupedGemmCluster kRoutedRowsCluster = GroupedGemmCluster::Single;

// y [R, N] (bf16) = x [R, K] (bf16) * w[g]^T, w [G, N, K] bf16.
void grouped_linear_forward_cutlass(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w,
                                    const Tensor& offsets, GroupedGemmSchedule schedule = kRoutedRowsSchedule,
                                    GroupedGemmCluster cluster = kRoutedRowsCluster);
// dx [R, K] (bf16) = dy [R, N] (bf16) * w[g] (overwrites dx).
void grouped_linear_backward_input_cutlass(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w,
                                           const Tensor& offsets, GroupedGemmSchedule schedule = kRoutedRowsSchedule,
                                           GroupedGemmCluster cluster = kRoutedRowsCluster);

// dw[g] [N, K] (f32) += dy_g^T * x_g (dy, x bf16): the group's sum is formed in f32 and then added to dw[g]; an
// empty group leaves dw[g] untouched. With accumulate = false, dw[g] = dy_g^T * x_g instead (an empty group's dw[g]
// becomes 0) and dw is never read: ~1.5x faster on the expert shapes, for the first write of a step (the public op's
// GradientWrite::Overwrite). Both forms run on either schedule.
// The public op's schedule for both forms: cooperative. On ping-pong the accumulating form was 8-10% faster alone and
// no faster in the step (seventeenth session); the overwriting form over a step's rows is timed by
// CudaGroupedGemmBench.DISABLED_ExpertWeightGradientOverAStep (thirty-fifth session, not yet on a GPU).
// Whether the gathered forward takes a token matrix of this many elements: its row sources are 32-bit offsets in
// 16-byte units (fewer than 2^35 elements); a larger one runs permute_forward and the forward instead.
inline bool cutlass_gathered_rows_fit(int64_t token_elements) { return token_elements / 8 <= int64_t{UINT32_MAX}; }
// y [R, N] = tokens[row_choice[r] / top_k] w[g]^T per group: grouped_linear_forward_cutlass on the rows
// permute_forward would write, gathered inside the GEMM's loads instead (the same bytes). tokens [T, K] (within
// cutlass_gathered_rows_fit), row_choice i32 [R]; the cooperative schedule on single CTAs.
void grouped_linear_forward_gathered_cutlass(const Stream& stream, const Tensor& y, const Tensor& tokens,
                                             const Tensor& row_choice, int64_t top_k, const Tensor& w,
                                             const Tensor& offsets);

inline constexpr GroupedGemmSchedule kWeightGradientSchedule = GroupedGemmSchedule::Cooperative;
void grouped_linear_backward_weight_cutlass(const Stream& stream, const Tensor& dw, const Tensor& dy, const Tensor& x,
                                            const Tensor& offsets, bool accumulate = true,
                                            GroupedGemmSchedule schedule = kWeightGradientSchedule);

// The exact lanes' dense GEMMs on the same bf16 instantiations, as one group of all R rows (no offsets); callers check
// cutlass_grouped_gemm_supported first (ops/cuda/gemm_batch_invariant.h). w [N, K] bf16.
// y [R, N] (bf16) = x [R, K] (bf16) * w^T.
void dense_linear_forward_cutlass(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w);
// dx [R, K] (bf16) = dy [R, N] (bf16) * w.
void dense_linear_backward_input_cutlass(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w);

}  // namespace moetrain::ops::cuda
