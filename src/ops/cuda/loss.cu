// defines: the CUDA cross-entropy kernels, the formulas of ops/cpu/loss.cpp in f32: lse = m + log(sum exp(x - m))
// with m the row maximum, loss = lse - x[target]; dlogits = scale * (exp(x - lse) - onehot). A row that fits is held
// in registers by a cluster of blocks (held_row_kernel): read from HBM once, its maximum, its sum of exponentials and
// its gradient all from those registers, so the forward + backward moves one read and one write of the [T, V] logits.
// Longer rows, and rows that are not in 16-byte packs, take one block per row: the forward reads each row once (the
// online softmax: a running maximum and a sum rescaled when it grows), the backward reads and writes it once; the
// fused form runs both on a row in one block, its second read partly from L2. Block reductions are a fixed tree:
// per-thread partials, a butterfly inside each warp, then the warp results in a fixed order (and the cluster's blocks
// in rank order). Under bf16 logits the exponentials take the hardware's exp2 (shifted_exp).
#include "ops/cuda/loss.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/float_io.cuh"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kWarps = kCrossEntropyThreads / 32;
constexpr int kFusedCrossEntropyBlocksPerSm = 2;  // the one-block fused kernel's grid (ops/cuda/loss.h)
constexpr int kTotalsThreads = 1024;
constexpr int64_t kMaxRowBlocks = int64_t(1) << 20;  // grid-stride beyond this

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// Butterfly inside the warp: every lane ends with the same bits.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduces one value per thread of a block of WARPS warps; every thread gets the result. `scratch` holds WARPS
// values; the caller's next use of it must come after a __syncthreads (the one at the start of the next call).
template <int WARPS, typename V, typename Op>
__device__ V block_reduce(V v, V* scratch, Op op) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = warp_reduce(v, op);
  __syncthreads();  // earlier readers of scratch are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  V total = scratch[0];
  for (int w = 1; w < WARPS; ++w) total = op(total, scratch[w]);  // every thread, the same order
  return total;
}

struct Add {
  template <typename V>
  __device__ V operator()(V a, V b) const {
    return a + b;
  }
};

// exp(d) of a shifted logit d = x - m <= 0 (m the row's maximum or its log-sum-exp), by the logits' dtype. f32 logits:
// expf, within an ulp. bf16 logits: one multiply and the hardware's exp2 (ex2.approx.ftz, ~2 ulp), three instructions
// for expf's eight in the two passes that are this kernel's arithmetic; the extra relative error, about 2^-23 |d|,
// stays far below the bf16 rounding of the gradient (2^-9) and moves the f32 log-sum-exp by ~1e-6 / |lse| relative.
template <typename T>
__device__ __forceinline__ float shifted_exp(float d) {
  if constexpr (std::is_same_v<T, float>) {
    return expf(d);
  } else {
    constexpr float kLog2e = 1.4426950408889634f;
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(d * kLog2e));
    return e;
  }
}

// A running (maximum, sum of exp(x - maximum)) pair: one pass over a row gives its log-sum-exp (the online softmax).
struct RunningSum {
  float max = -__builtin_huge_valf();
  float sum = 0.0f;
};

// Adds the values of `x` (the pack's own maximum first, so the sum is rescaled at most once per pack).
template <typename T, int N>
__device__ __forceinline__ void add_values(RunningSum& r, const float (&x)[N]) {
  float pack_max = x[0];
#pragma unroll
  for (int i = 1; i < N; ++i) pack_max = fmaxf(pack_max, x[i]);
  if (pack_max > r.max) {
    r.sum = r.sum == 0.0f ? 0.0f : r.sum * expf(r.max - pack_max);
    r.max = pack_max;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) r.sum += shifted_exp<T>(x[i] - r.max);
}

// Merges two running sums; symmetric in its arguments (fmaxf, and a sum of two products, commute), so a butterfly
// leaves the same bits in every lane. A side with nothing added (sum 0) adds nothing.
struct Merge {
  __device__ RunningSum operator()(RunningSum a, RunningSum b) const {
    RunningSum r;
    r.max = fmaxf(a.max, b.max);
    const float from_a = a.sum == 0.0f ? 0.0f : a.sum * expf(a.max - r.max);
    const float from_b = b.sum == 0.0f ? 0.0f : b.sum * expf(b.max - r.max);
    r.sum = from_a + from_b;
    return r;
  }
};

__device__ __forceinline__ RunningSum shuffle_xor(RunningSum v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
}

// Rows whose length and start allow 16-byte packs (V a multiple of kPack<T>, `packed`, chosen on the host by
// reduction_packs): each thread takes packs thread, thread + blockDim, ... (kUnroll loads in flight); otherwise one
// element at a time.
constexpr int kUnroll = 4;

// Calls f(p, x) for each of the thread's packs p of a packed row (x: the pack's values, zeros when !load), with the
// loads of kUnroll packs issued before any is used. Pack p starts at row + p * step (step N, or -N to walk backwards
// from the row's last pack).
template <typename T, typename F>
__device__ __forceinline__ void for_each_pack_strided(const T* row, int64_t step, int64_t packs, bool load, F&& f) {
  constexpr int N = kPack<T>;
  for (int64_t first = threadIdx.x; first < packs; first += int64_t{kUnroll} * blockDim.x) {
    float x[kUnroll][N] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = first + int64_t{u} * blockDim.x;
      if (p < packs && load) load_pack(row + p * step, x[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = first + int64_t{u} * blockDim.x;
      if (p < packs) f(p, x[u]);
    }
  }
}

template <typename T, typename F>
__device__ __forceinline__ void for_each_pack(const T* row, int64_t packs, bool load, F&& f) {
  for_each_pack_strided(row, int64_t{kPack<T>}, packs, load, f);
}

// The row's log-sum-exp, max + log(sum exp(x - max)), in one pass (the online softmax), returned to every thread.
// `scratch` holds kWarps partial sums; its previous readers must be done (the first __syncthreads sees to it).
template <typename T>
__device__ float row_log_sum_exp(const T* xr, int64_t vocab, bool packed, RunningSum* scratch) {
  constexpr int N = kPack<T>;
  RunningSum r;
  if (packed) {
    for_each_pack(xr, vocab / N, true, [&](int64_t, const float(&x)[N]) { add_values<T>(r, x); });
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float x[1] = {load_float(xr + v)};
      add_values<T>(r, x);
    }
  }
  // A butterfly in each warp, then the warps in order (every thread, the same order).
  for (int offset = 16; offset > 0; offset >>= 1) r = Merge{}(r, shuffle_xor(r, offset));
  __syncthreads();  // the previous row's readers of scratch are done
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = r;
  __syncthreads();
  RunningSum total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = Merge{}(total, scratch[w]);
  return total.max + logf(total.sum);
}

// Thread 0 writes the row's lse and loss = lse - x[target] (0 for an ignored row, NaN for a target outside [0, V)).
template <typename T>
__device__ void write_row_loss(float* losses, float* lse, int64_t t, float l, const T* xr, int64_t target,
                               int64_t vocab, int ignore_index) {
  if (threadIdx.x != 0) return;
  lse[t] = l;
  float loss = 0.0f;
  if (target != ignore_index) loss = target >= 0 && target < vocab ? l - load_float(xr + target) : quiet_nan();
  losses[t] = loss;
}

// One element of a row's gradient, scale * (exp(x - l) - [is_target]): 0 on an ignored row, NaN on a row whose target
// is outside [0, V). Every kernel's gradient is this function of (x, l), so a gradient made from a stored lse has the
// bits of one made where the lse was reduced.
template <typename T>
__device__ __forceinline__ float gradient_value(float x, float l, bool is_target, bool ignored, bool poisoned,
                                                float scale) {
  if (ignored) return 0.0f;
  if (poisoned) return quiet_nan();
  const float p = shifted_exp<T>(x - l);
  return scale * (is_target ? p - 1.0f : p);
}

// dxr = scale * (exp(x - l) - onehot(target)), one read and one write of the row; `reverse` walks it from its end.
// An ignored row is zero; a target outside [0, V) (not validated on the device) poisons the row with NaN. `l` is read
// only for a counted row.
template <typename T>
__device__ void write_row_gradient(T* dxr, const T* xr, int64_t vocab, int64_t target, float l, float scale,
                                   int ignore_index, bool packed, bool reverse) {
  constexpr int N = kPack<T>;
  const bool ignored = target == ignore_index;
  const bool poisoned = !ignored && (target < 0 || target >= vocab);
  if (ignored || poisoned) l = 0.0f;
  const auto gradient = [&](float x, bool is_target) {
    return gradient_value<T>(x, l, is_target, ignored, poisoned, scale);
  };
  if (packed) {
    const int64_t packs = vocab / N;
    const T* xs = reverse ? xr + (packs - 1) * N : xr;  // pack p of the walk is pack packs - 1 - p of the row
    const int64_t step = reverse ? -N : N;
    // The target's pack is found once per pack, its lane by a 32-bit compare per element (indexing the pack's
    // registers by a runtime lane would move them to local memory).
    const int64_t target_pack = ignored || poisoned ? -1 : target / N;
    const int target_lane = ignored || poisoned ? -1 : static_cast<int>(target % N);
    for_each_pack_strided(xs, step, packs, !ignored && !poisoned, [&](int64_t p, const float(&x)[N]) {
      const int64_t q = reverse ? packs - 1 - p : p;
      const int lane = q == target_pack ? target_lane : -1;
      float g[N];
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = gradient(x[i], i == lane);
      store_pack(dxr + q * N, g);
    });
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const int64_t v = reverse ? vocab - 1 - i : i;
      store_float(dxr + v, gradient(ignored || poisoned ? 0.0f : load_float(xr + v), v == target));
    }
  }
}

template <typename T>
__global__ void forward_kernel(float* losses, float* lse, const T* logits, const int32_t* targets, int64_t tokens,
                               int64_t vocab, int ignore_index, bool packed) {
  __shared__ RunningSum scratch[kWarps];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* xr = logits + t * vocab;
    const float l = row_log_sum_exp(xr, vocab, packed, scratch);
    write_row_loss(losses, lse, t, l, xr, targets[t], vocab, ignore_index);
  }
}

template <typename T>
__global__ void backward_kernel(T* dlogits, const T* logits, const float* lse, const int32_t* targets, int64_t tokens,
                                int64_t vocab, float scale, int ignore_index, bool packed) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t target = targets[t];
    const bool counted = target != ignore_index && target >= 0 && target < vocab;
    write_row_gradient(dlogits + t * vocab, logits + t * vocab, vocab, target, counted ? lse[t] : 0.0f, scale,
                       ignore_index, packed, /*reverse=*/false);
  }
}

// Both kernels' rows in one: the gradient pass follows the row's reduction, walking the row backwards.
template <typename T>
__global__ void forward_backward_kernel(float* losses, float* lse, T* dlogits, const T* logits, const int32_t* targets,
                                        int64_t tokens, int64_t vocab, float scale, int ignore_index, bool packed) {
  __shared__ RunningSum scratch[kWarps];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const T* xr = logits + t * vocab;
    const int64_t target = targets[t];
    const float l = row_log_sum_exp(xr, vocab, packed, scratch);
    write_row_loss(losses, lse, t, l, xr, target, vocab, ignore_index);
    __syncthreads();  // thread 0 has read x[target] before the row may be overwritten (dlogits == logits)
    write_row_gradient(dlogits + t * vocab, xr, vocab, target, l, scale, ignore_index, packed, /*reverse=*/true);
  }
}

// ---- Rows held in registers by a cluster of blocks ----
// A row of V = packs x N elements (N = kPack<T>, V a multiple of it) is split over a cluster of `ranks` blocks (1, 2, 4
// or 8): rank r takes packs [r s, min(packs, (r + 1) s)) with s = ceil(packs / ranks), and thread i of its block the
// packs i, i + blockDim, ... of that slice, at most kHeldPacks, which it keeps in registers. The row is read from HBM
// once; then its maximum (exact in any order), its sum of exp(x - maximum) (each thread its packs in order, a butterfly
// in each warp, the warps in order, then the ranks in order through distributed shared memory), and its gradient, all
// from the registers. The shape (ranks, threads) is a function of V and the dtype alone (held_row_shape), so a row's
// bits do not depend on T or on the other rows.
namespace cg = cooperative_groups;

constexpr int kHeldPacks = 10;       // 16-byte packs a thread holds (40 registers): the fastest of 6, 8, 10 and 12
constexpr int kMaxClusterRanks = 8;  // the portable cluster size
constexpr int kPreferredHeldThreads = 384;
constexpr int kMaxHeldThreads = 512;  // launch bounds that leave 128 registers a thread

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// The 8 or 4 values of a held pack, as load_pack reads them from memory. A bf16 value is its 16 bits shifted into
// the top of an f32 (exact); the shifts are volatile so that the compiler repeats them in each pass over the held
// packs instead of keeping 64 unpacked floats alive across the passes (102 registers a thread instead of ~64).
template <typename T>
__device__ __forceinline__ void unpack(const uint4& held, float (&x)[kPack<T>]) {
  if constexpr (std::is_same_v<T, float>) {
    x[0] = __uint_as_float(held.x), x[1] = __uint_as_float(held.y);
    x[2] = __uint_as_float(held.z), x[3] = __uint_as_float(held.w);
  } else {
    const uint32_t words[4] = {held.x, held.y, held.z, held.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t low, high;  // elements 2i (the word's low half) and 2i + 1, as __bfloat1622float2 orders them
      asm volatile("shl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xffff0000;" : "=r"(low), "=r"(high) : "r"(words[i]));
      x[2 * i] = __uint_as_float(low), x[2 * i + 1] = __uint_as_float(high);
    }
  }
}

// Calls f(p, x) for each pack p the thread holds, in order (pack first + j * stride for j < kHeldPacks, below end),
// with x its values unpacked.
template <typename T, typename F>
__device__ __forceinline__ void for_each_held(const uint4 (&held)[kHeldPacks], int first, int stride, int end, F&& f) {
#pragma unroll
  for (int j = 0; j < kHeldPacks; ++j) {
    const int p = first + j * stride;
    if (p >= end) continue;
    float x[kPack<T>];
    unpack<T>(held[j], x);
    f(p, x);
  }
}

// v reduced over the block (a butterfly in each warp, then the warps in order) and then over the cluster's blocks in
// rank order, through `slot` (a __shared__ value of each block, written once per kernel); every thread of the cluster
// gets the same bits. `warp_scratch` may be reused after the call: thread 0 reads it before the cluster barrier.
template <typename Op>
__device__ float cluster_reduce(float v, float* warp_scratch, float* slot, int ranks, Op op) {
  v = warp_reduce(v, op);
  if (threadIdx.x % 32 == 0) warp_scratch[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = warp_scratch[0];
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) total = op(total, warp_scratch[w]);
    *slot = total;
  }
  cg::this_cluster().sync();  // every block's slot is written and visible to the cluster
  float total = *cg::this_cluster().map_shared_rank(slot, 0);
  for (int r = 1; r < ranks; ++r) total = op(total, *cg::this_cluster().map_shared_rank(slot, r));
  return total;
}

// Row blockIdx.x / ranks: its loss and lse (by rank 0's thread 0) and, with kGradient, its gradient (dlogits may be
// logits: every block has read its slice, and rank 0 the target's logit, before the first cluster barrier, and no
// block writes before the second).
template <typename T, bool kGradient>
__global__ void __launch_bounds__(kMaxHeldThreads)
    held_row_kernel(float* losses, float* lse, T* dlogits, const T* logits, const int32_t* targets, int64_t vocab,
                    int ranks, float scale, int ignore_index) {
  constexpr int N = kPack<T>;
  __shared__ float warp_scratch[kMaxHeldThreads / 32];
  __shared__ float max_slot, sum_slot;
  const int rank = static_cast<int>(cg::this_cluster().block_rank());
  const int64_t t = blockIdx.x / ranks;
  // Pack indices within the row fit 32 bits (at most kMaxClusterRanks x kMaxHeldThreads x kHeldPacks): fewer registers.
  const int packs = static_cast<int>(vocab / N);
  const int slice = (packs + ranks - 1) / ranks;
  const int first = rank * slice + static_cast<int>(threadIdx.x);
  const int end = min(packs, (rank + 1) * slice);
  const int stride = static_cast<int>(blockDim.x);
  const T* xr = logits + t * vocab;
  uint4 held[kHeldPacks];
#pragma unroll
  for (int j = 0; j < kHeldPacks; ++j) {
    const int p = first + j * stride;
    if (p < end) held[j] = *reinterpret_cast<const uint4*>(xr + int64_t{p} * N);
  }
  const int64_t target = targets[t];
  const bool ignored = target == ignore_index;
  const bool poisoned = !ignored && (target < 0 || target >= vocab);
  float target_logit = 0.0f;
  if (rank == 0 && threadIdx.x == 0 && !ignored && !poisoned) target_logit = load_float(xr + target);

  float m = -__builtin_huge_valf();
  for_each_held<T>(held, first, stride, end, [&](int, const float(&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) m = fmaxf(m, x[i]);
  });
  m = cluster_reduce(m, warp_scratch, &max_slot, ranks, Max{});
  float sum = 0.0f;
  for_each_held<T>(held, first, stride, end, [&](int, const float(&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) sum += shifted_exp<T>(x[i] - m);
  });
  sum = cluster_reduce(sum, warp_scratch, &sum_slot, ranks, Add{});
  cg::this_cluster().barrier_arrive();  // this block's reads of the others' slots are done
  const float l = m + logf(sum);
  if (rank == 0 && threadIdx.x == 0) {
    lse[t] = l;
    losses[t] = ignored ? 0.0f : poisoned ? quiet_nan() : l - target_logit;
  }
  if constexpr (kGradient) {
    const float lg = ignored || poisoned ? 0.0f : l;
    const int target_pack = ignored || poisoned ? -1 : static_cast<int>(target / N);
    const int target_lane = ignored || poisoned ? -1 : static_cast<int>(target % N);
    T* dr = dlogits + t * vocab;
    for_each_held<T>(held, first, stride, end, [&](int p, const float(&x)[N]) {
      const int lane = p == target_pack ? target_lane : -1;
      float g[N];
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = gradient_value<T>(x[i], lg, i == lane, ignored, poisoned, scale);
      store_pack(dr + int64_t{p} * N, g);
    });
  }
  cg::this_cluster().barrier_wait();  // no block leaves while another may still read its slots
}

// Launches held_row_kernel over `tokens` rows, a cluster of shape.ranks blocks each.
template <typename T, bool kGradient>
void launch_held_rows(cudaStream_t stream, HeldRowShape shape, float* losses, float* lse, T* dlogits, const T* logits,
                      const int32_t* targets, int64_t tokens, int64_t vocab, float scale, int ignore_index) {
  MT_CHECK(tokens <= (int64_t{1} << 31) / kMaxClusterRanks - 1,
           "cross-entropy (CUDA): expected at most {} rows but found {}", (int64_t{1} << 31) / kMaxClusterRanks - 1,
           tokens);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(tokens * shape.ranks));
  config.blockDim = dim3(static_cast<unsigned>(shape.threads));
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = static_cast<unsigned>(shape.ranks);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  MT_CUDA_CHECK(cudaLaunchKernelEx(&config, held_row_kernel<T, kGradient>, losses, lse, dlogits, logits, targets, vocab,
                                   shape.ranks, scale, ignore_index));
}

// One block: thread i takes tokens i, i + blockDim, ... in f64, then a fixed tree over the block.
// out = {sum, count}: the count is exact in f64 below 2^53.
__global__ void totals_kernel(double* out, const float* losses, const int32_t* targets, int64_t tokens,
                              int ignore_index) {
  __shared__ double sum_scratch[kTotalsThreads / 32];
  __shared__ long long count_scratch[kTotalsThreads / 32];
  double sum = 0.0;
  long long count = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    if (targets[t] == ignore_index) continue;
    sum += static_cast<double>(losses[t]);
    ++count;
  }
  sum = block_reduce<kTotalsThreads / 32>(sum, sum_scratch, Add{});
  count = block_reduce<kTotalsThreads / 32>(count, count_scratch, Add{});
  if (threadIdx.x == 0) {
    out[0] = sum;
    out[1] = static_cast<double>(count);
  }
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks); }

// Calls f(T*) with the logits' element type, f32 or bf16.
template <typename F>
void dispatch_logits(const Tensor& logits, const char* op, F&& f) {
  switch (logits.dtype()) {
    case DType::F32: f(static_cast<float*>(nullptr)); return;
    case DType::BF16: f(static_cast<__nv_bfloat16*>(nullptr)); return;
    default: MT_FAIL("{} (CUDA): expected logits in f32 or bf16 but found {}", op, logits.describe());
  }
}

}  // namespace

// The fewest ranks whose blocks need at most kPreferredHeldThreads threads (several blocks an SM, so that one block's
// loads overlap another's arithmetic), else up to kMaxHeldThreads; ranks 0 for a row longer than that or not in packs.
HeldRowShape held_row_shape(bool packed, int64_t vocab, int pack) {
  if (!packed) return {};
  const int64_t packs = vocab / pack;
  for (const int limit : {kPreferredHeldThreads, kMaxHeldThreads}) {
    for (int ranks = 1; ranks <= kMaxClusterRanks; ranks *= 2) {
      const int64_t slice = (packs + ranks - 1) / ranks;
      const int64_t holders = (slice + kHeldPacks - 1) / kHeldPacks;            // threads of kHeldPacks each
      const int64_t threads = std::max<int64_t>(32, (holders + 31) / 32 * 32);  // in whole warps
      if (threads <= limit) return {ranks, static_cast<int>(threads)};
    }
  }
  return {};
}

void cross_entropy_forward(const Stream& stream, const Tensor& losses, const Tensor& lse, const Tensor& logits,
                           const Tensor& targets, int ignore_index) {
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_logits(logits, "cross_entropy_forward", [&]<typename T>(T*) {
    const bool packed = reduction_packs(stream, vocab, kPack<T>, {logits.raw_data()}, "cross_entropy_forward");
    auto* loss_rows = static_cast<float*>(losses.raw_data());
    auto* lse_rows = static_cast<float*>(lse.raw_data());
    const auto* x = static_cast<const T*>(logits.raw_data());
    const auto* target_rows = static_cast<const int32_t*>(targets.raw_data());
    if (const HeldRowShape shape = held_row_shape(packed, vocab, kPack<T>); shape.ranks > 0) {
      launch_held_rows<T, false>(cu_stream, shape, loss_rows, lse_rows, nullptr, x, target_rows, tokens, vocab, 0.0f,
                                 ignore_index);
      return;
    }
    forward_kernel<<<row_blocks(tokens), kCrossEntropyThreads, 0, cu_stream>>>(loss_rows, lse_rows, x, target_rows,
                                                                               tokens, vocab, ignore_index, packed);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_backward(const Stream& stream, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, double scale, int ignore_index) {
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_logits(logits, "cross_entropy_backward", [&]<typename T>(T*) {
    backward_kernel<<<row_blocks(tokens), kCrossEntropyThreads, 0, cu_stream>>>(
        static_cast<T*>(dlogits.raw_data()), static_cast<const T*>(logits.raw_data()),
        static_cast<const float*>(lse.raw_data()), static_cast<const int32_t*>(targets.raw_data()), tokens, vocab,
        static_cast<float>(scale), ignore_index,
        reduction_packs(stream, vocab, kPack<T>, {logits.raw_data(), dlogits.raw_data()}, "cross_entropy_backward"));
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_forward_backward(const Stream& stream, const Tensor& losses, const Tensor& lse,
                                    const Tensor& dlogits, const Tensor& logits, const Tensor& targets, double scale,
                                    int ignore_index) {
  const int64_t tokens = logits.size(0);
  const int64_t vocab = logits.size(1);
  if (tokens == 0) return;
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  dispatch_logits(logits, "cross_entropy_forward_backward", [&]<typename T>(T*) {
    const bool packed = reduction_packs(stream, vocab, kPack<T>, {logits.raw_data(), dlogits.raw_data()},
                                        "cross_entropy_forward_backward");
    auto* loss_rows = static_cast<float*>(losses.raw_data());
    auto* lse_rows = static_cast<float*>(lse.raw_data());
    auto* dx = static_cast<T*>(dlogits.raw_data());
    const auto* x = static_cast<const T*>(logits.raw_data());
    const auto* target_rows = static_cast<const int32_t*>(targets.raw_data());
    if (const HeldRowShape shape = held_row_shape(packed, vocab, kPack<T>); shape.ranks > 0) {
      launch_held_rows<T, true>(cu_stream, shape, loss_rows, lse_rows, dx, x, target_rows, tokens, vocab,
                                static_cast<float>(scale), ignore_index);
      return;
    }
    int device = 0, sms = 0;
    MT_CUDA_CHECK(cudaGetDevice(&device));
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int64_t blocks = std::min<int64_t>(tokens, int64_t{sms} * kFusedCrossEntropyBlocksPerSm);
    forward_backward_kernel<<<static_cast<unsigned>(blocks), kCrossEntropyThreads, 0, cu_stream>>>(
        loss_rows, lse_rows, dx, x, target_rows, tokens, vocab, static_cast<float>(scale), ignore_index, packed);
  });
  MT_CUDA_CHECK(cudaGetLastError());
}

void cross_entropy_totals(const Stream& stream, const Tensor& totals, const Tensor& losses, const Tensor& targets,
                          int ignore_index) {
  MT_CHECK(losses.dtype() == DType::F32, "cross_entropy_totals (CUDA): expected losses in f32 but found {}",
           losses.describe());
  MT_CHECK(totals.dtype() == DType::F64 && totals.numel() == 2 && totals.is_contiguous(),
           "cross_entropy_totals (CUDA): expected contiguous totals f64 [2] but found {}", totals.describe());
  const int64_t tokens = losses.numel();
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  totals_kernel<<<1, kTotalsThreads, 0, cu_stream>>>(
      static_cast<double*>(totals.raw_data()), static_cast<const float*>(losses.raw_data()),
      static_cast<const int32_t*>(targets.raw_data()), tokens, ignore_index);
  MT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace moetrain::ops::cuda
