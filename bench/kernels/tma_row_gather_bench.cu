// defines: tma_row_gather_bench, whether Hopper's TMA can gather a grouped GEMM's routed rows inside its loads. The
// expert GEMMs load A (the routed rows) as 128-row x 64-column tiles, one 2D TMA box each, from rows that
// permute_forward wrote in expert order beforehand. A gathered load takes each of the 128 rows from the token-side
// source instead, one 1 x 64 box per row at the row's index, into the same place of the same 128-byte-swizzled tile:
// the permutation's write and read (2 x 268 MB a layer and micro-batch at the workload's shape) would go.
// This times only the loads, at the workload of record's gate_up forward (65,536 routed rows of 8,192 tokens, K =
// 2,048, N = 1,536; tiles 128 x 256 x 64, 4 stages, one CTA per SM walking the tiles as the GEMM's persistent grid
// does), each way: one producer warp fills the stages and a consumer warp releases each as soon as it is full, so a
// pass takes as long as TMA needs to move the tiles. It also checks that a row box written at a 128-byte offset of a
// stage lands swizzled exactly as the whole tile's box lays it out (what wgmma reads).
// Prints one line per way and one JSON line (grep '^{"bench"').
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/error.h"
#include "event_timer.h"
#include "ops/cuda/check.h"

namespace {

constexpr int kTokens = 8192, kTopK = 8, kExperts = 128;
constexpr int kRows = kTokens * kTopK;  // routed rows
constexpr int kK = 2048, kN = 1536;     // hidden, gate_up width
constexpr int kTileM = 128, kTileN = 256, kTileK = 64, kStages = 4;
constexpr int kABytes = kTileM * kTileK * 2, kBBytes = kTileN * kTileK * 2;
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kRowBytes = kTileK * 2;  // one row box: 64 bf16, 128 bytes
constexpr int kWarmup = 3, kIterations = 20;

// How A's tile gets into shared memory.
enum class Load : int {
  Box = 0,       // one 128 x 64 box from the permuted rows (today's expert GEMMs)
  RowsWarp = 1,  // 128 boxes of 1 x 64 from the source by index, four a lane of the producer warp
  RowsOne = 2,   // the same 128 boxes issued by one thread, as CUTLASS's producer issues its copies
  CpAsync = 3,   // the rows by index in 16-byte cp.async copies of four producer warps, swizzled by hand
  CpAsync2 = 4,  // the same copies by two producer warps (what a CUTLASS producer warp group lends:
                 // ops/cuda/cutlass_gather_rows.cuh)
  CpAsync1 = 5,  // and by one
};

// Four producer warps for the cp.async copies (a thread per 16-byte chunk of 16 rows at a time), one otherwise; then
// the consumer warp.
__host__ __device__ constexpr int producer_warps(Load load) {
  return load == Load::CpAsync ? 4 : load == Load::CpAsync2 ? 2 : 1;
}
__host__ __device__ constexpr bool copies(Load load) {
  return load == Load::CpAsync || load == Load::CpAsync2 || load == Load::CpAsync1;
}
__host__ __device__ constexpr int threads_of(Load load) { return 32 * (producer_warps(load) + 1); }
constexpr int kCopyThreads = 128;  // the capture kernel's

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
  }
}

// One 2D TMA box at (column, row) of the map into shared memory, completing bytes on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int column, int row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(smem_address(bar))
      : "memory");
}

// 16 bytes global -> shared, bypassing L1; and the barrier arrival when this thread's earlier copies have landed (the
// barrier counts it among its expected arrivals).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_address(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Copy thread t's share of A's tile, one of kThreads: chunk t % 8 of rows t / 8, t / 8 + kThreads / 8, ..., each at
// the 128-byte swizzle's place of that chunk (chunk c of row r at r * 128 + 16 (c ^ (r % 8)), which is where TMA's
// SWIZZLE_128B puts it).
template <int kThreads = kCopyThreads>
__device__ __forceinline__ void copy_rows_by_thread(uint8_t* a, const __nv_bfloat16* source,
                                                    const int (&token)[kTileM * 8 / kThreads], int kb, int t) {
  const int chunk = t % 8;
#pragma unroll
  for (int i = 0; i < kTileM * 8 / kThreads; ++i) {
    const int r = t / 8 + kThreads / 8 * i;
    cp_async_16(a + r * kRowBytes + 16 * (chunk ^ (r % 8)), source + size_t(token[i]) * kK + kb * kTileK + chunk * 8);
  }
}

__device__ __forceinline__ uint8_t* aligned_stages(uint8_t* raw) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
}

// A's tile m, k-block kb into stage a: one box, or one box per row at the rows' indices (lane j of the producer warp
// takes rows j, j + 32, ...; with RowsOne lane 0 takes all).
template <Load kLoad>
__device__ __forceinline__ void load_a(uint8_t* a, const CUtensorMap* map, const int* row_index, int kb, int lane,
                                       uint64_t* bar) {
  if constexpr (kLoad == Load::Box) {
    if (lane == 0) tma_load_2d(a, map, kb * kTileK, 0, bar);
  } else if constexpr (kLoad == Load::RowsWarp) {
#pragma unroll
    for (int j = 0; j < kTileM / 32; ++j) {
      const int r = lane + 32 * j;
      tma_load_2d(a + r * kRowBytes, map, kb * kTileK, row_index[j], bar);
    }
  } else {
    if (lane == 0) {
      for (int r = 0; r < kTileM; ++r) tma_load_2d(a + r * kRowBytes, map, kb * kTileK, row_index[r], bar);
    }
  }
}

// The persistent load pass: CTA c takes tiles c, c + grid, ... of the (M / 128) x (N / 256) tiles, row tile major
// (the tiles that share A's rows run together, as the GEMM's rasterisation keeps them in L2), each over K / 64 stages.
// `a_map` is the permuted rows' map (Box) or the source's (Rows*), whose row r of row tile m is index[m * 128 + r];
// CpAsync reads `source` directly.
template <Load kLoad>
__global__ void __launch_bounds__(threads_of(kLoad), 1)
    load_pass_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                     const __nv_bfloat16* __restrict__ source, const int* __restrict__ index, int with_b) {
  extern __shared__ uint8_t raw[];
  uint8_t* stages = aligned_stages(raw);
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr bool kCopies = copies(kLoad);
  constexpr int kThreads = 32 * producer_warps(kLoad);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) barrier_init(&full[s], 1 + (kCopies ? kThreads : 0)), barrier_init(&empty[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  constexpr int m_tiles = kRows / kTileM, n_tiles = kN / kTileN, k_blocks = kK / kTileK;
  const uint32_t tma_bytes = (kCopies ? 0 : kABytes) + (with_b ? kBBytes : 0);
  int stage = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < m_tiles * n_tiles; tile += gridDim.x) {
    const int m = tile / n_tiles, n = tile % n_tiles;
    if (warp < producer_warps(kLoad)) {
      [[maybe_unused]] int row_index[kLoad == Load::RowsOne ? kTileM : kTileM * 8 / kThreads];
      if constexpr (kLoad == Load::RowsWarp) {
#pragma unroll
        for (int j = 0; j < kTileM / 32; ++j) row_index[j] = index[m * kTileM + lane + 32 * j];
      } else if constexpr (kLoad == Load::RowsOne) {
        for (int r = 0; r < kTileM; ++r) row_index[r] = index[m * kTileM + r];
      } else if constexpr (kCopies) {
#pragma unroll
        for (int i = 0; i < kTileM * 8 / kThreads; ++i)
          row_index[i] = index[m * kTileM + threadIdx.x / 8 + kThreads / 8 * i];
      }
      for (int kb = 0; kb < k_blocks; ++kb) {
        wait_parity(&empty[stage], phase ^ 1);
        uint8_t* a = stages + stage * kStageBytes;
        if (threadIdx.x == 0) {
          arrive_expect_bytes(&full[stage], tma_bytes);
          if (with_b) tma_load_2d(a + kABytes, &b_map, kb * kTileK, n * kTileN, &full[stage]);
        }
        if constexpr (kCopies) {
          copy_rows_by_thread<kThreads>(a, source, row_index, kb, threadIdx.x);
          cp_async_arrive(&full[stage]);
        } else {
          __syncwarp();
          if constexpr (kLoad == Load::Box) {
            if (lane == 0) tma_load_2d(a, &a_map, kb * kTileK, m * kTileM, &full[stage]);
          } else {
            load_a<kLoad>(a, &a_map, row_index, kb, lane, &full[stage]);
          }
        }
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    } else {
      for (int kb = 0; kb < k_blocks; ++kb) {
        wait_parity(&full[stage], phase);
        __syncwarp();  // every lane has seen this phase before the stage can be refilled
        if (lane == 0) arrive(&empty[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
  }
}

// Row tile m's k-block kb loaded three ways into three stages (the tile's box; a box per row; cp.async copies per
// chunk), copied out byte for byte: out[0, 16 KiB) the box's, then the row boxes', then the copies'. 128 threads.
__global__ void capture_kernel(const __grid_constant__ CUtensorMap box_map, const __grid_constant__ CUtensorMap row_map,
                               const __nv_bfloat16* __restrict__ source, const int* __restrict__ index, int m, int kb,
                               uint8_t* out) {
  extern __shared__ uint8_t raw[];
  uint8_t* stages = aligned_stages(raw);
  __shared__ __align__(8) uint64_t bar;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    barrier_init(&bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    int row_index[kTileM / 32];
    for (int j = 0; j < kTileM / 32; ++j) row_index[j] = index[m * kTileM + lane + 32 * j];
    if (lane == 0) {
      arrive_expect_bytes(&bar, 2 * kABytes);
      tma_load_2d(stages, &box_map, kb * kTileK, m * kTileM, &bar);
    }
    __syncwarp();
    load_a<Load::RowsWarp>(stages + kABytes, &row_map, row_index, kb, lane, &bar);
  }
  int token[8];
  for (int i = 0; i < 8; ++i) token[i] = index[m * kTileM + threadIdx.x / 8 + 16 * i];
  copy_rows_by_thread(stages + 2 * kABytes, source, token, kb, threadIdx.x);
  asm volatile("cp.async.wait_all;" ::: "memory");
  wait_parity(&bar, 0);
  __syncthreads();
  for (int i = threadIdx.x; i < 3 * kABytes; i += blockDim.x) out[i] = stages[i];
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  MT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  MT_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
           "tma_row_gather_bench: expected the driver's cuTensorMapEncodeTiled but it was not found");
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// A row-major [rows, cols] bf16 matrix's map with boxes of box_rows x 64 columns, 128-byte swizzle.
CUtensorMap tensor_map(const __nv_bfloat16* base, uint64_t rows, uint64_t cols, uint32_t box_rows) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  CUtensorMap map;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kTileK), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(base), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MT_CHECK(result == CUDA_SUCCESS, "tma_row_gather_bench: cuTensorMapEncodeTiled failed with {} ({} x {}, box {})",
           static_cast<int>(result), rows, cols, box_rows);
  return map;
}

// The routed rows in expert order, as the router's plan lays them out: each token's kTopK distinct experts drawn at
// random, the rows sorted by expert (tokens ascending within one). index[row] = the row's token.
std::vector<int> routed_row_tokens() {
  std::mt19937 gen(17);
  std::vector<int> experts(kExperts);
  std::vector<std::pair<int, int>> rows;  // (expert, token)
  rows.reserve(kRows);
  for (int t = 0; t < kTokens; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    for (int j = 0; j < kTopK; ++j) {
      std::uniform_int_distribution<int> pick(j, kExperts - 1);
      std::swap(experts[j], experts[pick(gen)]);
      rows.emplace_back(experts[j], t);
    }
  }
  std::sort(rows.begin(), rows.end());
  std::vector<int> index(kRows);
  for (int r = 0; r < kRows; ++r) index[r] = rows[r].second;
  return index;
}

template <typename F>
double seconds_per_pass(F&& f) {
  return moetrain::bench::seconds_per_call(nullptr, kWarmup, kIterations, f);
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* d = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&d, host.size() * sizeof(T)));
  MT_CUDA_CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

int run() {
  MT_CUDA_CHECK(cudaSetDevice(0));
  int sms = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const std::vector<int> index = routed_row_tokens();
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> source(size_t{kTokens} * kK), permuted(size_t{kRows} * kK), weight(size_t{kN} * kK);
  for (auto& x : source) x = __float2bfloat16(normal(gen));
  for (auto& x : weight) x = __float2bfloat16(normal(gen));
  for (int r = 0; r < kRows; ++r)
    std::memcpy(&permuted[size_t(r) * kK], &source[size_t(index[r]) * kK], kK * sizeof(__nv_bfloat16));
  __nv_bfloat16* d_source = device_copy(source);
  __nv_bfloat16* d_permuted = device_copy(permuted);
  __nv_bfloat16* d_weight = device_copy(weight);
  int* d_index = device_copy(index);
  const CUtensorMap box_map = tensor_map(d_permuted, kRows, kK, kTileM);
  const CUtensorMap row_map = tensor_map(d_source, kTokens, kK, 1);
  const CUtensorMap b_map = tensor_map(d_weight, kN, kK, kTileN);
  const int smem = kStages * kStageBytes + 1024;
  MT_CUDA_CHECK(cudaFuncSetAttribute(load_pass_kernel<Load::Box>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MT_CUDA_CHECK(
      cudaFuncSetAttribute(load_pass_kernel<Load::RowsWarp>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MT_CUDA_CHECK(
      cudaFuncSetAttribute(load_pass_kernel<Load::RowsOne>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MT_CUDA_CHECK(
      cudaFuncSetAttribute(load_pass_kernel<Load::CpAsync>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MT_CUDA_CHECK(
      cudaFuncSetAttribute(load_pass_kernel<Load::CpAsync2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MT_CUDA_CHECK(
      cudaFuncSetAttribute(load_pass_kernel<Load::CpAsync1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  // The bytes check: several row tiles and k-blocks, each loaded both ways.
  uint8_t* d_captured = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&d_captured, 3 * kABytes));
  const int capture_smem = 3 * kABytes + 1024;
  MT_CUDA_CHECK(cudaFuncSetAttribute(capture_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, capture_smem));
  std::vector<uint8_t> captured(3 * kABytes);
  int row_boxes_differ = 0, copies_differ = 0;
  for (const auto& [m, kb] : {std::pair{0, 0}, std::pair{1, 3}, std::pair{257, 31}, std::pair{511, 17}}) {
    capture_kernel<<<1, kCopyThreads, capture_smem>>>(box_map, row_map, d_source, d_index, m, kb, d_captured);
    MT_CUDA_CHECK(cudaGetLastError());
    MT_CUDA_CHECK(cudaMemcpy(captured.data(), d_captured, 3 * kABytes, cudaMemcpyDeviceToHost));
    row_boxes_differ += std::memcmp(captured.data(), captured.data() + kABytes, kABytes) != 0;
    copies_differ += std::memcmp(captured.data(), captured.data() + 2 * kABytes, kABytes) != 0;
  }
  const int mismatched = row_boxes_differ + copies_differ;
  std::printf("tile bytes against the tile's box, 4 tiles: row boxes %s (%d differ), cp.async copies %s (%d differ)\n",
              row_boxes_differ == 0 ? "identical" : "DIFFERENT", row_boxes_differ,
              copies_differ == 0 ? "identical" : "DIFFERENT", copies_differ);

  const double flops = 2.0 * kRows * double(kN) * kK;
  const double tiles = double(kRows / kTileM) * (kN / kTileN) * (kK / kTileK);
  struct Way {
    const char* name;
    Load load;
    int with_b;
  };
  const Way ways[] = {{"box_a", Load::Box, 0},
                      {"box_ab", Load::Box, 1},
                      {"rows_warp_a", Load::RowsWarp, 0},
                      {"rows_warp_ab", Load::RowsWarp, 1},
                      {"rows_one_thread_ab", Load::RowsOne, 1},
                      {"cp_async_a", Load::CpAsync, 0},
                      {"cp_async_ab", Load::CpAsync, 1},
                      {"cp_async_2warps_ab", Load::CpAsync2, 1},
                      {"cp_async_1warp_ab", Load::CpAsync1, 1}};
  std::vector<double> seconds;
  for (const Way& way : ways) {
    const double s = seconds_per_pass([&] {
      const CUtensorMap& a_map = way.load == Load::Box ? box_map : row_map;
      const auto launch = [&]<Load kLoad>() {
        load_pass_kernel<kLoad><<<sms, threads_of(kLoad), smem>>>(a_map, b_map, d_source, d_index, way.with_b);
      };
      if (way.load == Load::Box) {
        launch.template operator()<Load::Box>();
      } else if (way.load == Load::RowsWarp) {
        launch.template operator()<Load::RowsWarp>();
      } else if (way.load == Load::RowsOne) {
        launch.template operator()<Load::RowsOne>();
      } else if (way.load == Load::CpAsync) {
        launch.template operator()<Load::CpAsync>();
      } else if (way.load == Load::CpAsync2) {
        launch.template operator()<Load::CpAsync2>();
      } else {
        launch.template operator()<Load::CpAsync1>();
      }
      MT_CUDA_CHECK(cudaGetLastError());
    });
    seconds.push_back(s);
  }
  for (size_t i = 0; i < seconds.size(); ++i) {
    const double bytes = tiles * (kABytes + (ways[i].with_b ? kBBytes : 0));
    std::printf(
        "%-20s %8.3f ms a pass  %6.2f TB/s into shared memory  %5.0f ns a stage a CTA  "
        "the GEMM's FLOPs in this time: %6.0f TFLOP/s\n",
        ways[i].name, seconds[i] * 1e3, bytes / seconds[i] * 1e-12, seconds[i] * 1e9 * sms / tiles,
        flops / seconds[i] * 1e-12);
  }
  std::printf("{\"bench\":\"tma_row_gather\",\"sms\":%d,\"identical\":%s", sms, mismatched == 0 ? "true" : "false");
  for (size_t i = 0; i < seconds.size(); ++i) std::printf(",\"%s\":%.4f", ways[i].name, seconds[i] * 1e3);
  std::printf("}\n");
  MT_CUDA_CHECK(cudaFree(d_captured));
  MT_CUDA_CHECK(cudaFree(d_source));
  MT_CUDA_CHECK(cudaFree(d_permuted));
  MT_CUDA_CHECK(cudaFree(d_weight));
  MT_CUDA_CHECK(cudaFree(d_index));
  return mismatched == 0 ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tma_row_gather_bench: %s\n", e.what());
    return 2;
  }
}
