// defines: the grouped forward GEMM whose A rows are gathered inside its loads: y_g = x[token(r)] w[g]^T for the routed
// rows r of group g, where token(r) = row_choice[r] / top_k, without the [rows, K] permuted copy of x that
// permute_forward writes. CUTLASS's ptr-array TMA mainloop (ops/cuda/cutlass_grouped.cuh) with its producer changed:
// the weight tile still comes by TMA, while two producer warps copy A's 128 rows from the token rows themselves, 16
// bytes a lane at a time (cp.async), to where TMA's 128-byte swizzle would have put them. Hopper's TMA has no row
// gather, and one TMA box per row moves a tile ~5x slower than the multiplications use it; copies by a few warps alone
// keep up (bench/kernels/tma_row_gather_bench.cu). Every tile is the same multiply in the same order as over the
// permuted copy: the same bits. A copy is four instructions (the tile's row sources sit in shared memory, the
// swizzled destinations are compile-time steps from two per lane). At the workload's gate_up shape on an H100 it runs
// at 0.94-1.02x of permute_forward and the TMA forward together, as fast over contiguous rows as over gathered ones
// (its cp.async stages, not the scattered rows, are what it loses to TMA), and in the training step it took 1.3 ms
// and ~16 J a step more than the two ops (forty-first session in docs/gpu_notes.md), so the layers do not use it.
#pragma once

#include <cstdint>

#include "ops/cuda/cutlass_grouped.cuh"

namespace moetrain::ops::cuda::cutlass_grouped {

// A dispatch policy that is Base's but for one trait: the kernel layer runs the producer warp group's second warp
// (MainloopAux) beside the mainloop's, calling the collective's load_auxiliary, as for CUTLASS's blockwise-scaled FP8
// mainloop.
template <class BasePolicy>
struct GatherRowsPolicy : BasePolicy {};

}  // namespace moetrain::ops::cuda::cutlass_grouped

namespace cutlass::gemm::kernel::detail {
template <class BasePolicy>
struct HasAuxiliaryLoad<moetrain::ops::cuda::cutlass_grouped::GatherRowsPolicy<BasePolicy>> : cute::true_type {};
}  // namespace cutlass::gemm::kernel::detail

namespace moetrain::ops::cuda::cutlass_grouped {

// The mainloop of Base (a CUTLASS MainloopSm90ArrayTmaGmmaWarpSpecialized collective over K-major bf16 A and B) with
// A gathered by two producer warps: the mainloop's warp copies the first half of A's rows and issues B's TMA, the
// auxiliary warp copies the second half (one warp's copies alone kept the tensor cores waiting: 275 against 610
// TFLOP/s at the workload's gate_up shape on an H100). The kernel layer calls tensors_perform_update with each new
// group before that group's loads, which is how each warp learns the group it loads for.
template <class Base>
struct GatherRowsMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TileShape;
  using DispatchPolicy = GatherRowsPolicy<typename Base::DispatchPolicy>;

  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kStages = cute::size<2>(SmemLayoutA{});
  static constexpr int kChunk = 16 / static_cast<int>(sizeof(Bf16));  // elements a 16-byte copy moves
  static constexpr int kChunksPerRow = kTileK / kChunk;
  static constexpr int kRowStep = 32 / kChunksPerRow;        // rows a warp's copy instruction covers
  static constexpr int kWarpRows = kTileM / 2;               // the rows each of the two producer warps copies
  static constexpr int kCopiesPerLane = kWarpRows / kRowStep;  // a lane's copies a K block
  static_assert(kChunksPerRow == 8 && kRowStep == 4 && kWarpRows % 32 == 0 && kCopiesPerLane % 8 == 0,
                "a warp copies 128-byte rows of A's tile, four a copy instruction (K blocks of 64 bf16)");
  static_assert(cute::size<0>(typename DispatchPolicy::ClusterShape{}) == 1 &&
                    cute::size<1>(typename DispatchPolicy::ClusterShape{}) == 1,
                "gathered rows are loaded by each CTA for itself: clusters (TMA multicast) are not supported");

  // A's tile is TMA's 128-byte swizzle over plain row-major stages: element (row, column, stage) at byte
  // ((row + stage * kTileM) * kTileK + column) * 2 of the tile, bits 4-6 of the shared address XORed with bits 7-9.
  // Rows r and r + 8, and stages, are therefore whole multiples of 1,024 bytes apart with the same swizzle, so a lane's
  // copies are two swizzled addresses (its rows q and q + 4) plus compile-time steps: a copy is a few instructions.
  static constexpr int kRowBlockBytes = 8 * kTileK * static_cast<int>(sizeof(Bf16));
  static constexpr int kStageBytes = kTileM * kTileK * static_cast<int>(sizeof(Bf16));
  static constexpr bool plain_rows_under_the_swizzle() {
    const auto rows = cute::get_nonswizzle_portion(SmemLayoutA{});
    for (int stage = 0; stage < kStages; ++stage)
      for (int row = 0; row < kTileM; ++row)
        for (int c = 0; c < kTileK; c += kChunk)
          if (static_cast<int>(rows(row, c, stage)) != (row + stage * kTileM) * kTileK + c) return false;
    return true;
  }
  static_assert(cute::is_same_v<decltype(cute::get_swizzle_portion(SmemLayoutA{})), cute::Swizzle<3, 4, 3>> &&
                    plain_rows_under_the_swizzle(),
                "A's shared tile is expected as row-major stages of 128-byte rows under TMA's 128-byte swizzle");

  // The full barrier counts the mainloop warp's leader (its arrival expects B's TMA bytes) and the auxiliary
  // warp's 32 lanes (each arriving once its copies have landed); the mainloop warp's copies join the phase without
  // counting (cp.async.mbarrier.arrive without .noinc).
  static constexpr int NumProducerThreadEvents = 1 + 32;
  static constexpr uint32_t kTmaBytesB =
      cutlass::bits_to_bytes(cute::size<0>(SmemLayoutB{}) * cute::size<1>(SmemLayoutB{}) *
                             static_cast<uint32_t>(cute::sizeof_bits<typename Base::ElementB>::value));

  // Base's shared tiles and, for each producer warp, its current tile's row sources: the offset of each of its rows'
  // token row from `tokens`, in 16-byte units, ordered so that a lane's rows q, q + 4, q + 8, q + 12 are one 16-byte
  // load.
  struct TensorStorage : Base::TensorStorage {
    alignas(16) uint32_t row_source[2][kWarpRows];
  };

  // The gathered rows' description lives in device memory (the cached plan's buffer, rewritten by each call), so the
  // kernel's parameters stay those the plan was initialised with.
  struct Arguments : Base::Arguments {
    const GatheredRows* gathered;
  };
  struct Params : Base::Params {
    const GatheredRows* gathered;
  };

  int group_ = 0;  // the group this producer warp loads for

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params params{Base::to_underlying_arguments(problem_shapes, args, workspace), args.gathered};
    params.tma_transaction_bytes = kTmaBytesB;
    return params;
  }

  template <class InputTensors, class ProblemShapeMNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& input_tensors, Params const& params,
                                                     ProblemShapeMNKL problem_shape_mnkl, int32_t next_batch) {
    group_ = next_batch;
    return Base::tensors_perform_update(input_tensors, params, problem_shape_mnkl, next_batch);
  }

  // One producer warp's half of A's rows for the tile at row tile m_coord of the current group. First each lane
  // writes the sources of the half's rows lane and lane + 32 into shared memory; rows past the group's end read
  // token 0 (their products are never stored: each output row depends on its own A row alone). Then per K block the
  // lane copies chunk lane % 8 of the half's rows q, q + 4, ..., q + 60 (q = lane / 8; a copy instruction reads four
  // whole 128-byte rows; columns past K are zeros, as TMA fills them) and has the stage's full barrier wait for them
  // (`arrive`).
  template <int kHalf, class KTileIterator, class Arrive>
  CUTLASS_DEVICE void copy_rows(Params const& params, MainloopPipeline& pipeline, PipelineState& smem_pipe_write,
                                int m_coord, KTileIterator& k_tile_iter, int k_tile_count, int lane,
                                TensorStorage& shared_tensors, Arrive&& arrive) {
    const GatheredRows g = *params.gathered;
    int begin = 0, end = 0;
    group_rows(g.offsets, group_, g.rows, &begin, &end);
    const int first_row = kHalf * kWarpRows;  // within the tile
    uint32_t* row_source = shared_tensors.row_source[kHalf];
    const uint32_t row_units = static_cast<uint32_t>(g.k / kChunk);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kWarpRows / 32; ++j) {
      const int h = lane + 32 * j;  // within the half
      const int row = begin + m_coord * kTileM + first_row + h;
      const uint32_t token = row < end ? static_cast<uint32_t>(g.row_choice[row] / g.top_k) : 0u;
      row_source[(h % kRowStep) * kCopiesPerLane + h / kRowStep] = token * row_units;
    }
    __syncwarp();
    const int q = lane / kChunksPerRow, chunk = lane % kChunksPerRow;
    const uint4* lane_sources = reinterpret_cast<const uint4*>(row_source + q * kCopiesPerLane);
    cute::Tensor sA = cute::make_tensor(cute::make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    const uint32_t to_even = cute::cast_smem_ptr_to_uint(&sA(first_row + q, chunk * kChunk, 0));
    const uint32_t to_odd = cute::cast_smem_ptr_to_uint(&sA(first_row + q + kRowStep, chunk * kChunk, 0));
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);  // every lane waits; the mainloop warp's lane 0 expects B's bytes
      const int write_stage = smem_pipe_write.index();
      const int column = static_cast<int>(*k_tile_iter) * kTileK + chunk * kChunk;
      const bool inside = column < g.k;
      const char* from = reinterpret_cast<const char*>(g.tokens + (inside ? column : 0));
      const uint32_t bytes = inside ? 16u : 0u;
      const uint32_t stage = static_cast<uint32_t>(write_stage * kStageBytes);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCopiesPerLane / 4; ++j) {
        const uint4 sources = lane_sources[j];
        const uint32_t source[4] = {sources.x, sources.y, sources.z, sources.w};
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int i = 4 * j + e;  // the lane's row q + 4 i
          const uint32_t to = (i % 2 == 0 ? to_even : to_odd) + stage + (i / 2) * kRowBlockBytes;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(from + uint64_t{source[e]} * 16),
                       "r"(bytes)
                       : "memory");
        }
      }
      arrive(reinterpret_cast<uint64_t const*>(pipeline.producer_get_barrier(smem_pipe_write)), write_stage,
             k_tile_iter);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // The mainloop warp: the first half of A's rows, then B's TMA, which the barrier expects (issued after every lane's
  // copies have joined the phase, so the phase cannot complete before those land).
  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           [[maybe_unused]] uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using cute::_;
    const int lane = thread_idx % 32;
    cute::Tensor sB = cute::make_tensor(cute::make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    auto block_tma_b = params.tma_load_b.get_slice(0);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    cute::Tensor gB = cute::get<1>(load_inputs)(_, _, n_coord, _, l_coord);  // (BLK_N, BLK_K, k)
    cute::Tensor tBgB = block_tma_b.partition_S(gB);
    cute::Tensor tBsB = block_tma_b.partition_D(sB);
    copy_rows<0>(params, pipeline, smem_pipe_write, static_cast<int>(m_coord), k_tile_iter, k_tile_count, lane,
                 shared_tensors, [&](uint64_t const* barrier, int write_stage, KTileIterator const& k) {
                   cutlass::arch::cpasync_barrier_arrive(barrier);
                   __syncwarp();
                   if (lane == 0) {
                     auto* tma_barrier = reinterpret_cast<typename MainloopPipeline::ProducerBarrierType*>(
                         const_cast<uint64_t*>(barrier));
                     cute::copy(params.tma_load_b.with(cute::get<1>(input_tensormaps), *tma_barrier, uint16_t{0}),
                                tBgB(_, _, _, *k), tBsB(_, _, _, write_stage));
                   }
                 });
  }

  // The auxiliary warp: the second half of A's rows, each lane one of the barrier's expected arrivals.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     [[maybe_unused]] cute::tuple<TensorA, TensorB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int thread_idx, [[maybe_unused]] uint32_t block_rank_in_cluster,
                                     TensorStorage& shared_tensors) {
    copy_rows<1>(params, pipeline, smem_pipe_write, static_cast<int>(cute::get<0>(blk_coord)), k_tile_iter,
                 k_tile_count, thread_idx % 32, shared_tensors, [](uint64_t const* barrier, int, KTileIterator const&) {
                   cutlass::arch::cpasync_barrier_arrive_noinc(barrier);
                 });
  }
};

// The forward GEMM of ForwardGemmOn<Schedule> with A gathered (a single CTA per cluster).
template <class Schedule = CooperativeSchedule<ClusterSingle>>
struct GatheredForwardGemm {
  using Plain = ForwardGemmOn<Schedule>;
  using CollectiveMainloop = GatherRowsMainloop<typename Plain::CollectiveMainloop>;
  using CollectiveEpilogue = typename Plain::CollectiveEpilogue;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(Kernel::SharedStorageSize <= 227 * 1024, "the row sources must fit beside the stages in shared memory");
  using NonVoidC = typename Plain::NonVoidC;
  using StrideA = typename Plain::StrideA;
  using StrideB = typename Plain::StrideB;
  using StrideC = typename Plain::StrideC;
  using StrideD = typename Plain::StrideD;
};

// Fills a gathered forward's arguments: the row source, then group g's problem (m_g, N, K), weights and output rows
// (thread g). A's pointers are the token rows, which the mainloop never loads through; only its TMA descriptor is
// built on them.
template <class Config>
__global__ void build_gathered_arguments(DeviceArrays<Config> arrays, GatheredRows gathered, const Bf16* w, Bf16* y,
                                         int groups, int n_out, int n_in) {
  if (threadIdx.x == 0) *arrays.gathered = gathered;
  for (int g = static_cast<int>(threadIdx.x); g < groups; g += static_cast<int>(blockDim.x)) {
    int begin = 0, end = 0;
    group_rows(gathered.offsets, g, gathered.rows, &begin, &end);
    arrays.problems[g] = Problem(end - begin, n_out, n_in);
    arrays.ptr_a[g] = gathered.tokens;
    arrays.ptr_b[g] = w + static_cast<int64_t>(g) * n_out * n_in;
    arrays.ptr_d[g] = y + static_cast<int64_t>(begin) * n_out;
    arrays.stride_a[g] = leading_stride<typename Config::StrideA>(n_in);
    arrays.stride_b[g] = leading_stride<typename Config::StrideB>(n_in);
    arrays.stride_d[g] = leading_stride<typename Config::StrideD>(n_out);
  }
}

// y [R, N] = tokens[row_choice[r] / top_k] w[g]^T for the rows r of group g (offsets [G + 1]); w [G, N, K].
template <class Config>
void run_gathered_forward(const Stream& stream, const Tensor& y, const Tensor& tokens, const Tensor& row_choice,
                          int64_t top_k, const Tensor& w, const Tensor& offsets, const char* op_name) {
  const int64_t rows = y.size(0), groups = w.size(0), n_out = w.size(1), n_in = w.size(2);
  if (rows == 0 || groups == 0) return;
  check_int(rows, op_name, "rows R");
  check_int(groups, op_name, "groups G");
  check_int(n_out, op_name, "N");
  check_int(n_in, op_name, "K");
  check_int(top_k, op_name, "top_k");
  MT_CHECK(cutlass_gathered_rows_fit(tokens.numel()),
           "{}: expected tokens of fewer than 2^35 elements (the row sources are 32-bit offsets in 16-byte units), "
           "found {}",
           op_name, tokens.numel());
  const int g = static_cast<int>(groups), n = static_cast<int>(n_out), k = static_cast<int>(n_in);
  Plan<Config>& plan = get_plan<Config>(OpKind::kForwardGathered, stream, y.device(), g, n, k, false, op_name);
  GatheredRows gathered;
  gathered.tokens = static_cast<const Bf16*>(tokens.raw_data());
  gathered.row_choice = row_choice.data<int32_t>();
  gathered.offsets = offsets.data<int32_t>();
  gathered.rows = static_cast<int>(rows);
  gathered.top_k = static_cast<int>(top_k);
  gathered.k = k;
  auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const int threads = std::min(1024, (g + 31) / 32 * 32);
  build_gathered_arguments<Config><<<1, threads, 0, cu_stream>>>(
      plan.arrays, gathered, static_cast<const Bf16*>(w.raw_data()), static_cast<Bf16*>(y.raw_data()), g, n, k);
  MT_CUDA_CHECK(cudaGetLastError());
  const cutlass::Status status = plan.gemm.run(cu_stream);
  MT_CHECK(status == cutlass::Status::kSuccess, "{} (CUTLASS): launching the gathered grouped kernel failed: {}",
           op_name, status_name(status));
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda::cutlass_grouped
