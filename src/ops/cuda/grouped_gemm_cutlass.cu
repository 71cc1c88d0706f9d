// defines: the grouped expert GEMMs on the CUTLASS machinery of ops/cuda/cutlass_grouped.cuh. Sixteen instantiations:
// forward and backward input on the cooperative and the ping-pong schedule, each with three cluster shapes; the
// weight gradient accumulating into f32 dw (C = D = dw, beta = 1) or overwriting dw (no C), on either schedule.
#include "ops/cuda/grouped_gemm_cutlass.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "ops/cuda/cutlass_gather_rows.cuh"
#include "ops/cuda/cutlass_grouped.cuh"

namespace moetrain::ops::cuda {

namespace {

using namespace cutlass_grouped;

// dw[g] = 0 for every empty group g (the overwriting weight gradient gives them no tiles). Grid (chunks, G): the
// blocks of non-empty groups exit at once.
__global__ void zero_empty_groups_kernel(float* __restrict__ dw, const int32_t* __restrict__ offsets, int rows,
                                         int64_t group_elements) {
  const int g = static_cast<int>(blockIdx.y);
  int begin = 0, end = 0;
  group_rows(offsets, g, rows, &begin, &end);
  if (begin != end) return;
  float* dwg = dw + static_cast<int64_t>(g) * group_elements;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < group_elements; i += stride) {
    dwg[i] = 0.0f;
  }
}

void zero_empty_groups(const Stream& stream, const Tensor& dw, const Tensor& offsets, int64_t rows, const char* op) {
  const int64_t groups = dw.size(0), group_elements = dw.size(1) * dw.size(2);
  if (groups == 0 || group_elements == 0) return;
  check_int(rows, op, "rows R");
  MT_CHECK(groups <= 65535, "{} (CUTLASS): {} groups exceed the grid's 65535", op, groups);
  constexpr int kThreads = 256;
  const int64_t chunks = std::min<int64_t>(64, (group_elements + kThreads - 1) / kThreads);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(groups));
  zero_empty_groups_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream_handle(stream))>>>(
      dw.data<float>(), offsets.data<int32_t>(), static_cast<int>(rows), group_elements);
  MT_CUDA_CHECK(cudaGetLastError());
}

// Calls run.template operator()<Schedule>(op) with the schedule type of (schedule, cluster) for an output `width`
// wide: pairs along N become a single CTA where the output's 256-wide tiles are odd in number (a pair would pad N by
// a tile).
template <class Run>
void with_routed_rows_schedule(GroupedGemmSchedule schedule, GroupedGemmCluster cluster, int64_t width, const char* op,
                               Run&& run) {
  const bool pingpong = schedule == GroupedGemmSchedule::Pingpong;
  constexpr int64_t kTileWidth = cute::size<1>(typename PingpongSchedule<>::TileShape{});
  static_assert(kTileWidth == cute::size<1>(typename CooperativeSchedule<>::TileShape{}));
  const int64_t tiles = (width + kTileWidth - 1) / kTileWidth;
  if (cluster == GroupedGemmCluster::PairAlongN && tiles % 2 != 0) cluster = GroupedGemmCluster::Single;
  switch (cluster) {
    case GroupedGemmCluster::PairAlongM:
      return pingpong ? run.template operator()<PingpongSchedule<ClusterPairAlongM>>(op)
                      : run.template operator()<CooperativeSchedule<ClusterPairAlongM>>(op);
    case GroupedGemmCluster::Single:
      return pingpong ? run.template operator()<PingpongSchedule<ClusterSingle>>(op)
                      : run.template operator()<CooperativeSchedule<ClusterSingle>>(op);
    case GroupedGemmCluster::PairAlongN:
      return pingpong ? run.template operator()<PingpongSchedule<ClusterPairAlongN>>(op)
                      : run.template operator()<CooperativeSchedule<ClusterPairAlongN>>(op);
  }
  MT_FAIL("{} (CUTLASS): unknown cluster {}", op, static_cast<int>(cluster));
}

}  // namespace

bool cutlass_grouped_gemm_supported(DType activations, int64_t rows, int64_t n_out, int64_t n_in,
                                    std::initializer_list<const Tensor*> tensors) {
  if (activations != DType::BF16) return false;
  if (n_out <= 0 || n_in <= 0 || n_out % kCutlassGroupedAlignment != 0 || n_in % kCutlassGroupedAlignment != 0) {
    return false;
  }
  if (rows > INT_MAX || n_out > INT_MAX || n_in > INT_MAX) return false;
  return std::all_of(tensors.begin(), tensors.end(), [](const Tensor* t) { return aligned16(*t); });
}

void grouped_linear_forward_cutlass(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w,
                                    const Tensor& offsets, GroupedGemmSchedule schedule, GroupedGemmCluster cluster) {
  with_routed_rows_schedule(
      schedule, cluster, w.size(1), "grouped_linear_forward", [&]<class Schedule>(const char* op) {
        run_grouped<ForwardGemmOn<Schedule>, OpKind::kForward>(stream, x, w, y, offsets.data<int32_t>(), w.size(0),
                                                               x.size(0), w.size(1), w.size(2), op);
      });
}

void grouped_linear_forward_gathered_cutlass(const Stream& stream, const Tensor& y, const Tensor& tokens,
                                             const Tensor& row_choice, int64_t top_k, const Tensor& w,
                                             const Tensor& offsets) {
  run_gathered_forward<GatheredForwardGemm<>>(stream, y, tokens, row_choice, top_k, w, offsets,
                                              "grouped_linear_forward_gathered");
}

void grouped_linear_backward_input_cutlass(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w,
                                           const Tensor& offsets, GroupedGemmSchedule schedule,
                                           GroupedGemmCluster cluster) {
  with_routed_rows_schedule(
      schedule, cluster, w.size(2), "grouped_linear_backward_input", [&]<class Schedule>(const char* op) {
        run_grouped<BackwardInputGemmOn<Schedule>, OpKind::kBackwardInput>(
            stream, dy, w, dx, offsets.data<int32_t>(), w.size(0), dy.size(0), w.size(1), w.size(2), op);
      });
}

void grouped_linear_backward_weight_cutlass(const Stream& stream, const Tensor& dw, const Tensor& dy, const Tensor& x,
                                            const Tensor& offsets, bool accumulate, GroupedGemmSchedule schedule) {
  constexpr const char* op = "grouped_linear_backward_weight";
  if (accumulate && schedule == GroupedGemmSchedule::Pingpong) {
    run_grouped<BackwardWeightPingpongGemm, OpKind::kBackwardWeight>(stream, dy, x, dw, offsets.data<int32_t>(),
                                                                     dw.size(0), x.size(0), dw.size(1), dw.size(2), op);
    return;
  }
  if (accumulate) {
    run_grouped<BackwardWeightGemm, OpKind::kBackwardWeight>(stream, dy, x, dw, offsets.data<int32_t>(), dw.size(0),
                                                             x.size(0), dw.size(1), dw.size(2), op);
    return;
  }
  if (schedule == GroupedGemmSchedule::Pingpong) {
    run_grouped<BackwardWeightOverwritePingpongGemm, OpKind::kBackwardWeightOverwrite>(
        stream, dy, x, dw, offsets.data<int32_t>(), dw.size(0), x.size(0), dw.size(1), dw.size(2), op);
  } else {
    run_grouped<BackwardWeightOverwriteGemm, OpKind::kBackwardWeightOverwrite>(
        stream, dy, x, dw, offsets.data<int32_t>(), dw.size(0), x.size(0), dw.size(1), dw.size(2), op);
  }
  zero_empty_groups(stream, dw, offsets, x.size(0), op);
}

void dense_linear_forward_cutlass(const Stream& stream, const Tensor& y, const Tensor& x, const Tensor& w) {
  run_grouped<ForwardGemm, OpKind::kForward>(stream, x, w, y, nullptr, 1, x.size(0), w.size(0), w.size(1),
                                             "linear_forward");
}

void dense_linear_backward_input_cutlass(const Stream& stream, const Tensor& dx, const Tensor& dy, const Tensor& w) {
  run_grouped<BackwardInputGemm, OpKind::kBackwardInput>(stream, dy, w, dx, nullptr, 1, dy.size(0), w.size(0),
                                                         w.size(1), "linear_backward_input");
}

}  // namespace moetrain::ops::cuda
