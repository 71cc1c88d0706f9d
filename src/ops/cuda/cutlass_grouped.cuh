// defines: the machinery shared by the CUTLASS GEMMs (ops/cuda/grouped_gemm_cutlass.h, the grouped expert GEMMs,
// and ops/cuda/gemm_batch_invariant.h, the exact lanes' dense GEMMs as one group): CUTLASS 4's Hopper ptr-array
// grouped kernels (after CUTLASS example 57_hopper_grouped_gemm and PyTorch's _grouped_mm): TMA loads, wgmma,
// warp-specialised schedules (cooperative 128 x 256 x 64 or ping-pong 64 x 256 x 64 tiles, clusters of 2 x 1, and for
// the ops over routed rows 1 x 1 and 1 x 2 too), a persistent grid over all groups' tiles, no split-K. A small kernel
// turns the device offsets into the per-group problem sizes, pointers and strides the GEMM reads (no host copy, no
// synchronisation); the GEMM object and its device workspace are built once per (op, stream, G, N, K) and cached.
// Each output tile is computed by one warp group or CTA along the whole reduction in a fixed order, so a row's result
// depends on its own operands and (N, K) alone.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"
#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda::cutlass_grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using Problem = ProblemShape::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

// The cluster shapes (M, N, 1): how many CTAs share one operand tile through TMA multicast. CUTLASS's grouped tile
// scheduler rounds each group's tiles along M up to a multiple of the cluster's M extent, and along N to its N extent
// (sm90_tile_scheduler_group.hpp, problem_blocks_m / _n); the tiles it adds run the whole mainloop on zeros. So with
// pairs along M (the weight tile multicast to two row tiles) a group's rows are padded to a multiple of two row tiles
// (128 rows of ping-pong tiles, 256 of cooperative ones), which costs the expert GEMMs of a routed step (512 +- 22
// rows a group) an eighth to a quarter more tiles. A single CTA (no multicast) or pairs along N (the row tile
// multicast to two weight tiles) pad the rows to one tile; pairs along N pad N to two tiles (512) instead.
using ClusterPairAlongM = cute::Shape<cute::_2, cute::_1, cute::_1>;
using ClusterSingle = cute::Shape<cute::_1, cute::_1, cute::_1>;
using ClusterPairAlongN = cute::Shape<cute::_1, cute::_2, cute::_1>;

// The cooperative schedule: the two consumer warp groups share one 128 x 256 tile, and a tile's epilogue follows its
// mainloop. The tile configuration PyTorch picks for groups of more than 128 rows.
template <class Cluster = ClusterPairAlongM>
struct CooperativeSchedule {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = Cluster;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// The ping-pong schedule: each consumer warp group owns a 64 x 256 tile and the two take turns on the tensor cores, so
// one group's epilogue runs while the other multiplies. Written for the accumulating expert weight gradient, whose
// epilogue reads and writes the f32 gradient (8 bytes an element against a reduction over ~500 rows): on the
// cooperative schedule that traffic does not overlap the tensor cores. Its 64-row tiles also halve the rows a group
// of routed rows is padded by (forward, backward input).
template <class Cluster = ClusterPairAlongM>
struct PingpongSchedule {
  using TileShape = cute::Shape<cute::_64, cute::_256, cute::_64>;
  using ClusterShape = Cluster;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// One grouped GEMM D_g [M, N] = A_g [M, K] * B_g [K, N] (+ C_g when ElementC is not void) in CUTLASS's terms: LayoutA
// RowMajor = A K-contiguous, ColumnMajor = M-contiguous; LayoutB ColumnMajor = B K-contiguous ([N, K] rows),
// RowMajor = N-contiguous. C and D are row-major. Few tile configurations keep the compile short.
template <class LayoutA, class LayoutB, class ElementC, class ElementD, class Schedule = CooperativeSchedule<>>
struct GroupedGemm {
  using TileShape = typename Schedule::TileShape;
  using ClusterShape = typename Schedule::ClusterShape;
  using KernelSchedule = typename Schedule::Kernel;
  using EpilogueSchedule = typename Schedule::Epilogue;
  using NonVoidC = std::conditional_t<std::is_void_v<ElementC>, ElementD, ElementC>;
  static constexpr int kAlignmentAB = 16 / static_cast<int>(sizeof(Bf16));
  static constexpr int kAlignmentD = 16 / static_cast<int>(sizeof(ElementD));
  static constexpr int kAlignmentC = 16 / static_cast<int>(sizeof(NonVoidC));

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor*, kAlignmentC,
      ElementD, cutlass::layout::RowMajor*, kAlignmentD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlignmentAB, Bf16, LayoutB*, kAlignmentAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
};

// y = x w^T: A = x_g [m, K] row-major, B = w[g] [N, K] (K-contiguous), D = y_g [m, N].
template <class Schedule>
using ForwardGemmOn = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, Bf16, Schedule>;
// dx = dy w: A = dy_g [m, N] row-major, B(n, k) = w[g][n][k] (N-contiguous in GEMM terms), D = dx_g [m, K].
template <class Schedule>
using BackwardInputGemmOn = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, Bf16, Schedule>;
using ForwardGemm = ForwardGemmOn<CooperativeSchedule<>>;
using BackwardInputGemm = BackwardInputGemmOn<CooperativeSchedule<>>;
// dw += dy^T x: A(n, r) = dy_g[r][n] (M-contiguous), B(r, k) = x_g[r][k] (N-contiguous), C = D = dw[g] [N, K] f32.
using BackwardWeightGemm = GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float>;
// The same on the ping-pong schedule (the epilogue's f32 traffic beside the other warp group's multiplications).
using BackwardWeightPingpongGemm =
    GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float, PingpongSchedule<>>;
// dw = dy^T x without reading dw (C void): the f32 read of the accumulation is ~1/3 of the weight gradient's time on
// the expert shapes. Empty groups get no tiles here; zero_empty_groups writes their zeros.
using BackwardWeightOverwriteGemm = GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, void, float>;
// The same on the ping-pong schedule: over a step's rows (~4,096 a group on the workload) each tile's reduction is
// long and its f32 write comes once, beside the other warp group's multiplications instead of after its own.
using BackwardWeightOverwritePingpongGemm =
    GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, void, float, PingpongSchedule<>>;
// The exact lanes' dense GEMMs with an f32 output (ops/cuda/gemm_batch_invariant.h): y = x w^T, dx = dy w, and
// dx += dy w (C = D = dx).
using ForwardF32Gemm = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, float>;
using BackwardInputF32Gemm = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, void, float>;
using BackwardInputF32AccumulateGemm = GroupedGemm<cutlass::layout::RowMajor, cutlass::layout::RowMajor, float, float>;

// Where a gathered GEMM's A rows come from (ops/cuda/cutlass_gather_rows.cuh): routed row r (counted over all groups)
// is row row_choice[r] / top_k of `tokens` ([tokens, K] row-major); `offsets` [G + 1] are the groups' routed rows, as
// the GEMM's problem sizes.
struct GatheredRows {
  const Bf16* tokens = nullptr;
  const int32_t* row_choice = nullptr;
  const int32_t* offsets = nullptr;
  int rows = 0;  // routed rows in all (the offsets are clamped into [0, rows])
  int top_k = 1;
  int k = 0;  // the row length (elements)
};

// The per-group argument arrays the GEMM reads, carved out of one device buffer (and a gathered GEMM's row source).
template <class Config>
struct DeviceArrays {
  Problem* problems;
  const Bf16** ptr_a;
  const Bf16** ptr_b;
  const typename Config::NonVoidC** ptr_c;
  typename Config::NonVoidC** ptr_d;
  typename Config::StrideA* stride_a;
  typename Config::StrideB* stride_b;
  typename Config::StrideC* stride_c;
  typename Config::StrideD* stride_d;
  GatheredRows* gathered;
};

// A packed 2-D stride whose one dynamic mode (the leading dimension; the other mode is 1, the group mode 0) is `ld`.
template <class Stride>
__device__ __forceinline__ Stride leading_stride(int64_t ld) {
  static_assert(cute::rank_v<Stride> == 3, "expected an (M|N, K, L) stride");
  Stride s{};
  if constexpr (cute::is_static_v<std::remove_cvref_t<decltype(cute::get<0>(s))>>) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// Group g's rows [begin, end), clamped into [0, rows] (device offsets are not checked on the host). No offsets: one
// group of all rows (the dense GEMMs of ops/cuda/gemm_batch_invariant.h).
__device__ __forceinline__ void group_rows(const int32_t* offsets, int g, int rows, int* begin, int* end) {
  if (offsets == nullptr) {
    *begin = 0;
    *end = rows;
    return;
  }
  const int b = min(max(offsets[g], 0), rows);
  const int e = min(max(offsets[g + 1], 0), rows);
  *begin = b;
  *end = max(e, b);
}

// The problem an instantiation computes. kBackwardInputAccumulate is kBackwardInput with C = D = dx (beta = 1), and
// kBackwardWeight kBackwardWeightOverwrite's with C = D = dw.
enum class OpKind : int {
  kForward = 0,
  kBackwardInput = 1,
  kBackwardWeight = 2,
  kBackwardWeightOverwrite = 3,
  kBackwardInputAccumulate = 4,
  kForwardGathered = 5,  // kForward with A's rows gathered (ops/cuda/cutlass_gather_rows.cuh)
};

constexpr bool accumulates(OpKind op) {
  return op == OpKind::kBackwardWeight || op == OpKind::kBackwardInputAccumulate;
}

// Fills the argument arrays of group g = thread (one block-stride loop; G is small). a, b and out are the op's
// tensors: forward (x, w, y), backward input (dy, w, dx), backward weight (dy, x, dw).
template <class Config, OpKind kOp>
__global__ void build_group_arguments(DeviceArrays<Config> arrays, const Bf16* a, const Bf16* b,
                                      typename Config::NonVoidC* out, const int32_t* __restrict__ offsets, int groups,
                                      int rows, int n_out, int n_in) {
  for (int g = static_cast<int>(threadIdx.x); g < groups; g += static_cast<int>(blockDim.x)) {
    int begin = 0, end = 0;
    group_rows(offsets, g, rows, &begin, &end);
    const int m = end - begin;
    const int64_t weight_offset = static_cast<int64_t>(g) * n_out * n_in;
    if constexpr (kOp == OpKind::kForward) {  // (m, N, K): x_g [m, K], w[g] [N, K], y_g [m, N]
      arrays.problems[g] = Problem(m, n_out, n_in);
      arrays.ptr_a[g] = a + static_cast<int64_t>(begin) * n_in;
      arrays.ptr_b[g] = b + weight_offset;
      arrays.ptr_d[g] = out + static_cast<int64_t>(begin) * n_out;
      arrays.stride_a[g] = leading_stride<typename Config::StrideA>(n_in);
      arrays.stride_b[g] = leading_stride<typename Config::StrideB>(n_in);
      arrays.stride_d[g] = leading_stride<typename Config::StrideD>(n_out);
    } else if constexpr (kOp == OpKind::kBackwardInput ||
                         kOp == OpKind::kBackwardInputAccumulate) {  // (m, K, N): dy_g [m, N], w[g] [N, K], dx_g [m, K]
      arrays.problems[g] = Problem(m, n_in, n_out);
      arrays.ptr_a[g] = a + static_cast<int64_t>(begin) * n_out;
      arrays.ptr_b[g] = b + weight_offset;
      arrays.ptr_c[g] = out + static_cast<int64_t>(begin) * n_in;
      arrays.ptr_d[g] = out + static_cast<int64_t>(begin) * n_in;
      arrays.stride_a[g] = leading_stride<typename Config::StrideA>(n_out);
      arrays.stride_b[g] = leading_stride<typename Config::StrideB>(n_in);
      arrays.stride_c[g] = leading_stride<typename Config::StrideC>(n_in);
      arrays.stride_d[g] = leading_stride<typename Config::StrideD>(n_in);
    } else {  // kBackwardWeight*: (N, K, m): dy_g^T [N, m], x_g [m, K], dw[g] [N, K]. An empty group gets no tiles (M =
              // 0), so its dw[g] is neither read nor written.
      arrays.problems[g] = m > 0 ? Problem(n_out, n_in, m) : Problem(0, n_in, 0);
      arrays.ptr_a[g] = a + static_cast<int64_t>(begin) * n_out;
      arrays.ptr_b[g] = b + static_cast<int64_t>(begin) * n_in;
      arrays.ptr_c[g] = out + weight_offset;
      arrays.ptr_d[g] = out + weight_offset;
      arrays.stride_a[g] = leading_stride<typename Config::StrideA>(n_out);
      arrays.stride_b[g] = leading_stride<typename Config::StrideB>(n_in);
      arrays.stride_c[g] = leading_stride<typename Config::StrideC>(n_in);
      arrays.stride_d[g] = leading_stride<typename Config::StrideD>(n_in);
    }
  }
}

inline constexpr size_t kSectionAlignment = 128;  // TMA descriptors built on the pointer arrays need >= 16 bytes
inline size_t align_up(size_t v) { return (v + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment; }

// A GEMM initialised once for one (op, stream, G, N, K): its argument arrays and CUTLASS workspace live in `buffer`
// (one stream-ordered allocation), and the kernel parameters point at them, so a call only refills the arrays.
template <class Config>
struct Plan {
  Tensor buffer;
  DeviceArrays<Config> arrays{};
  typename Config::Gemm gemm;
};

inline const char* status_name(cutlass::Status status) { return cutlass::cutlassGetStatusString(status); }

inline int sm_count(int device) {
  static std::mutex mutex;
  static std::map<int, int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = counts.find(device);
  if (it == counts.end()) {
    int count = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    it = counts.emplace(device, count).first;
  }
  return it->second;
}

template <class Config>
typename Config::Gemm::Arguments make_arguments(const DeviceArrays<Config>& arrays, int groups, int device,
                                                bool accumulate) {
  typename Config::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {groups, arrays.problems, nullptr};  // sizes only on the device
  args.mainloop.ptr_A = arrays.ptr_a;
  args.mainloop.dA = arrays.stride_a;
  args.mainloop.ptr_B = arrays.ptr_b;
  args.mainloop.dB = arrays.stride_b;
  if constexpr (requires { args.mainloop.gathered; }) args.mainloop.gathered = arrays.gathered;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = accumulate ? 1.0f : 0.0f;
  // Without accumulation C is void (no source read); its stride array is never read, the D one stands in.
  using PtrC = decltype(args.epilogue.ptr_C);
  using StridePtrC = decltype(args.epilogue.dC);
  args.epilogue.ptr_C = accumulate ? reinterpret_cast<PtrC>(arrays.ptr_c) : nullptr;
  args.epilogue.dC =
      accumulate ? reinterpret_cast<StridePtrC>(arrays.stride_c) : reinterpret_cast<StridePtrC>(arrays.stride_d);
  args.epilogue.ptr_D = arrays.ptr_d;
  args.epilogue.dD = arrays.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count(device);
  return args;
}

// The cached plan for (op, stream, G, N, K), built on first use. Plans live for the process (never freed: they are
// small, and freeing pool memory during static destruction would outlive the CUDA runtime).
template <class Config>
Plan<Config>& get_plan(OpKind op, const Stream& stream, Device device, int groups, int n_out, int n_in, bool accumulate,
                       const char* op_name) {
  using Key = std::tuple<int, void*, int, int, int>;
  static std::mutex mutex;
  static auto* plans = new std::map<Key, std::unique_ptr<Plan<Config>>>();
  std::lock_guard<std::mutex> lock(mutex);
  const Key key{static_cast<int>(op), stream.native(), groups, n_out, n_in};
  auto it = plans->find(key);
  if (it != plans->end()) return *it->second;

  auto plan = std::make_unique<Plan<Config>>();
  const size_t g = static_cast<size_t>(groups);
  size_t offset = 0;
  auto section = [&](size_t bytes) {
    const size_t at = offset;
    offset = align_up(offset + bytes);
    return at;
  };
  const size_t at_problems = section(g * sizeof(Problem));
  const size_t at_a = section(g * sizeof(void*)), at_b = section(g * sizeof(void*));
  const size_t at_c = section(g * sizeof(void*)), at_d = section(g * sizeof(void*));
  const size_t at_sa = section(g * sizeof(typename Config::StrideA));
  const size_t at_sb = section(g * sizeof(typename Config::StrideB));
  const size_t at_sc = section(g * sizeof(typename Config::StrideC));
  const size_t at_sd = section(g * sizeof(typename Config::StrideD));
  const size_t at_gathered = section(sizeof(GatheredRows));
  const size_t at_workspace = offset;

  // The workspace size depends on G and the SM count, not on pointer values: size it with null arrays first.
  const size_t workspace_bytes = Config::Gemm::get_workspace_size(
      make_arguments<Config>(DeviceArrays<Config>{}, groups, device.index, accumulate));
  plan->buffer = Tensor::empty({static_cast<int64_t>(at_workspace + workspace_bytes)}, DType::U8, device);
  auto* base = static_cast<uint8_t*>(plan->buffer.raw_data());
  MT_CHECK(reinterpret_cast<uintptr_t>(base) % kSectionAlignment == 0,
           "{} (CUTLASS): expected a {}-byte aligned workspace but the pool returned {}", op_name, kSectionAlignment,
           static_cast<void*>(base));
  DeviceArrays<Config>& arrays = plan->arrays;
  arrays.problems = reinterpret_cast<Problem*>(base + at_problems);
  arrays.ptr_a = reinterpret_cast<const Bf16**>(base + at_a);
  arrays.ptr_b = reinterpret_cast<const Bf16**>(base + at_b);
  arrays.ptr_c = reinterpret_cast<const typename Config::NonVoidC**>(base + at_c);
  arrays.ptr_d = reinterpret_cast<typename Config::NonVoidC**>(base + at_d);
  arrays.stride_a = reinterpret_cast<typename Config::StrideA*>(base + at_sa);
  arrays.stride_b = reinterpret_cast<typename Config::StrideB*>(base + at_sb);
  arrays.stride_c = reinterpret_cast<typename Config::StrideC*>(base + at_sc);
  arrays.stride_d = reinterpret_cast<typename Config::StrideD*>(base + at_sd);
  arrays.gathered = reinterpret_cast<GatheredRows*>(base + at_gathered);

  const auto args = make_arguments<Config>(arrays, groups, device.index, accumulate);
  const cutlass::Status can = plan->gemm.can_implement(args);
  MT_CHECK(can == cutlass::Status::kSuccess, "{} (CUTLASS): the grouped kernel cannot run G = {}, N = {}, K = {}: {}",
           op_name, groups, n_out, n_in, status_name(can));
  const cutlass::Status init =
      plan->gemm.initialize(args, base + at_workspace, static_cast<cudaStream_t>(stream_handle(stream)));
  MT_CHECK(init == cutlass::Status::kSuccess, "{} (CUTLASS): initialising the grouped kernel failed: {}", op_name,
           status_name(init));
  MT_CUDA_CHECK(cudaGetLastError());
  return *plans->emplace(key, std::move(plan)).first->second;
}

inline void check_int(int64_t value, const char* op, const char* what) {
  MT_CHECK(value >= 0 && value <= INT_MAX, "{} (CUTLASS): {} = {} exceeds the kernels' 32-bit range", op, what, value);
}

// offsets: the device offsets of the groups, or nullptr for one group of all rows (groups must then be 1).
template <class Config, OpKind kOp>
void run_grouped(const Stream& stream, const Tensor& a, const Tensor& b, const Tensor& out, const int32_t* offsets,
                 int64_t groups, int64_t rows, int64_t n_out, int64_t n_in, const char* op_name) {
  if (rows == 0 || groups == 0) return;  // no rows: nothing to compute (and nothing to add to dw)
  check_int(rows, op_name, "rows R");
  check_int(groups, op_name, "groups G");
  check_int(n_out, op_name, "N");
  check_int(n_in, op_name, "K");
  const int g = static_cast<int>(groups), r = static_cast<int>(rows), n = static_cast<int>(n_out),
            k = static_cast<int>(n_in);
  constexpr bool kAccumulate = accumulates(kOp);
  Plan<Config>& plan = get_plan<Config>(kOp, stream, out.device(), g, n, k, kAccumulate, op_name);
  auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const int threads = std::min(1024, (g + 31) / 32 * 32);
  build_group_arguments<Config, kOp><<<1, threads, 0, cu_stream>>>(
      plan.arrays, static_cast<const Bf16*>(a.raw_data()), static_cast<const Bf16*>(b.raw_data()),
      static_cast<typename Config::NonVoidC*>(out.raw_data()), offsets, g, r, n, k);
  MT_CUDA_CHECK(cudaGetLastError());
  const cutlass::Status status = plan.gemm.run(cu_stream);
  MT_CHECK(status == cutlass::Status::kSuccess, "{} (CUTLASS): launching the grouped kernel failed: {}", op_name,
           status_name(status));
  MT_CUDA_CHECK(cudaGetLastError());
}

inline bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; }

}  // namespace moetrain::ops::cuda::cutlass_grouped
