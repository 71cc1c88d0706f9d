// defines: the CUDA optimizer kernels: AdamW with the explicit round-to-nearest intrinsics (__fmul_rn, ...), which
// nvcc never fuses into a multiply-add, so each step rounds exactly as the CPU's -ffp-contract=off code does (its
// moments in f32 or kept in bf16, rounded as the CPU rounds them); sums
// of squares as two fixed trees in f64 (within chunks, then over the chunks); the multi-tensor AdamW runs the same
// element code over a cached device table of tensors, chunk by chunk (four elements per 16-byte load where the
// chunk is aligned), and can write each param's bf16 copy.
#include "ops/cuda/optim.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include <cuda_runtime.h>

#include "ops/cuda/check.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t(1) << 16;  // grid-stride beyond this
constexpr int kReduceThreads = 256;

// The f32 scalars of ops/cpu/optim.cpp, rounded from the same doubles.
struct AdamWScalars {
  float decay;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_step_size;
  float bias_correction2_sqrt;
  float eps;
  float grad_scale;  // the clip's coefficient, as cuda::scale_inplace rounds it
  bool apply_decay;
  bool scale_grad;
};

// One element of the AdamW update, ops/cpu/optim.cpp's steps each rounded to nearest in f32, on values in registers.
__device__ __forceinline__ void adamw_update(float& param, float& avg, float& avg_sq, float grad,
                                             const AdamWScalars& s) {
  const bool small_weight = fabsf(s.one_minus_beta1) < 0.5f;
  if (s.scale_grad) grad = __fmul_rn(grad, s.grad_scale);  // grad.mul_(clip_coef)
  if (s.apply_decay) param = __fmul_rn(param, s.decay);    // param.mul_(1 - lr * wd)
  // exp_avg.lerp_(grad, 1 - b1), at::lerp's two branches.
  const float diff = __fsub_rn(grad, avg);
  avg = small_weight ? __fadd_rn(avg, __fmul_rn(s.one_minus_beta1, diff))
                     : __fsub_rn(grad, __fmul_rn(diff, __fsub_rn(1.0f, s.one_minus_beta1)));
  avg_sq = __fmul_rn(avg_sq, s.beta2);                                              // exp_avg_sq.mul_(b2)
  avg_sq = __fadd_rn(avg_sq, __fmul_rn(s.one_minus_beta2, __fmul_rn(grad, grad)));  // .addcmul_(g, g, 1 - b2)
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(avg_sq), s.bias_correction2_sqrt), s.eps);
  param = __fadd_rn(param, __fmul_rn(s.neg_step_size, __fdiv_rn(avg, denom)));  // param.addcdiv_(m, denom, -ss)
}

// core/dtype.cpp's f32_to_bf16_bits (the rule ops::cast applies): nearest even; NaN keeps its sign and upper payload
// and is forced quiet. (A copy of ops/cuda/elementwise.cu's private helper.)
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float value) {
  const uint32_t bits = __float_as_uint(value);
  if (value != value) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// Four f32 values as four bf16 (each rounded as above), packed for one 8-byte store.
__device__ __forceinline__ uint2 pack_bf16x4(const float4& x) {
  return uint2{uint32_t(f32_to_bf16_bits(x.x)) | (uint32_t(f32_to_bf16_bits(x.y)) << 16),
               uint32_t(f32_to_bf16_bits(x.z)) | (uint32_t(f32_to_bf16_bits(x.w)) << 16)};
}

// A moment element: f32, or kept in bf16 (widened exactly when read, rounded to nearest even when written).
template <bool kBf16Moments>
__device__ __forceinline__ float load_moment(const void* moment, int64_t i) {
  if constexpr (kBf16Moments) {
    return __uint_as_float(uint32_t(static_cast<const uint16_t*>(moment)[i]) << 16);
  } else {
    return static_cast<const float*>(moment)[i];
  }
}

template <bool kBf16Moments>
__device__ __forceinline__ void store_moment(void* moment, int64_t i, float value) {
  if constexpr (kBf16Moments) {
    static_cast<uint16_t*>(moment)[i] = f32_to_bf16_bits(value);
  } else {
    static_cast<float*>(moment)[i] = value;
  }
}

template <bool kBf16Moments>
__device__ __forceinline__ float4 load_moment4(const void* moment, int64_t i) {
  if constexpr (kBf16Moments) {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(moment) + i);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
  } else {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(moment) + i);
  }
}

template <bool kBf16Moments>
__device__ __forceinline__ void store_moment4(void* moment, int64_t i, const float4& value) {
  if constexpr (kBf16Moments) {
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(moment) + i) = pack_bf16x4(value);
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(moment) + i) = value;
  }
}

// The same on element i in memory.
template <bool kBf16Moments>
__device__ __forceinline__ void adamw_element(float* p, void* m, void* v, const float* g, int64_t i,
                                              const AdamWScalars& s) {
  float param = p[i], avg = load_moment<kBf16Moments>(m, i), avg_sq = load_moment<kBf16Moments>(v, i);
  adamw_update(param, avg, avg_sq, g[i], s);
  p[i] = param;
  store_moment<kBf16Moments>(m, i, avg);
  store_moment<kBf16Moments>(v, i, avg_sq);
}

template <bool kBf16Moments>
__global__ void adamw_kernel(float* p, void* m, void* v, const float* g, int64_t n, AdamWScalars s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    adamw_element<kBf16Moments>(p, m, v, g, i, s);
  }
}

enum CopyKind : int32_t { kNoCopy = 0, kCopyBf16 = 1, kCopyF32 = 2 };

// One row of the multi-tensor table: a non-empty tensor, its first chunk in the launch's chunk numbering and its
// weight decay. No implicit padding (the rows are compared bytewise to find a cached table).
struct MultiTensorEntry {
  float* p;
  void* m;  // f32, or bf16 when moments_bf16 (the whole launch's moments are in one dtype)
  void* v;
  const float* g;
  void* copy;  // nullptr when copy_kind == kNoCopy
  int64_t numel;
  int64_t first_chunk;
  double weight_decay;
  int32_t copy_kind;
  int32_t moments_bf16;  // part of the cached table's key
};
static_assert(sizeof(MultiTensorEntry) == 5 * sizeof(void*) + 3 * 8 + 2 * 4, "MultiTensorEntry must not be padded");

// Whether a chunk [begin, end) of a table row can move four elements per load: a whole number of fours, with the
// f32 streams on 16 bytes and the bf16 ones (moments, copy) on 8 (the tensors' bases decide; chunks start at
// multiples of 8192).
template <bool kBf16Moments>
__device__ __forceinline__ bool four_aligned(const MultiTensorEntry& e, int64_t begin, int64_t end) {
  const auto on = [](const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  if ((end - begin) % 4 != 0) return false;
  if (!on(e.p + begin, 16) || !on(e.g + begin, 16)) return false;
  const size_t moment_bytes = kBf16Moments ? 2 : 4;
  const auto moment_at = [&](const void* base) { return static_cast<const char*>(base) + begin * moment_bytes; };
  if (!on(moment_at(e.m), 4 * moment_bytes) || !on(moment_at(e.v), 4 * moment_bytes)) return false;
  if (e.copy_kind == kCopyBf16) return on(static_cast<uint16_t*>(e.copy) + begin, 8);
  if (e.copy_kind == kCopyF32) return on(static_cast<float*>(e.copy) + begin, 16);
  return true;
}

// The chunk four elements per thread at a time: 16-byte loads and stores (8-byte for bf16 streams), the same element
// code, the same bytes.
template <bool kBf16Moments>
__device__ __forceinline__ void adamw_chunk_by_four(const MultiTensorEntry& e, int64_t begin, int64_t end,
                                                    const AdamWScalars& t) {
  for (int64_t i = begin + 4 * static_cast<int64_t>(threadIdx.x); i < end; i += 4 * static_cast<int64_t>(blockDim.x)) {
    float4 p = *reinterpret_cast<const float4*>(e.p + i);
    float4 m = load_moment4<kBf16Moments>(e.m, i);
    float4 v = load_moment4<kBf16Moments>(e.v, i);
    const float4 g = *reinterpret_cast<const float4*>(e.g + i);
    adamw_update(p.x, m.x, v.x, g.x, t);
    adamw_update(p.y, m.y, v.y, g.y, t);
    adamw_update(p.z, m.z, v.z, g.z, t);
    adamw_update(p.w, m.w, v.w, g.w, t);
    *reinterpret_cast<float4*>(e.p + i) = p;
    store_moment4<kBf16Moments>(e.m, i, m);
    store_moment4<kBf16Moments>(e.v, i, v);
    if (e.copy_kind == kCopyBf16) {
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(e.copy) + i) = pack_bf16x4(p);
    } else if (e.copy_kind == kCopyF32) {
      *reinterpret_cast<float4*>(static_cast<float*>(e.copy) + i) = p;
    }
  }
}

// Block b takes chunks b, b + gridDim.x, ...; a chunk is kAdamWMultiChunk consecutive elements of one tensor (the
// last chunk of a tensor may be shorter). `s` holds the scalars shared by all tensors; the decay is per tensor.
template <bool kBf16Moments>
__global__ void adamw_multi_kernel(const MultiTensorEntry* table, int32_t entries, int64_t total_chunks, double lr,
                                   AdamWScalars s) {
  for (int64_t chunk = blockIdx.x; chunk < total_chunks; chunk += gridDim.x) {
    // The last row whose first_chunk <= chunk (rows are in ascending first_chunk, each with >= 1 chunk).
    int32_t lo = 0, hi = entries - 1;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo + 1) / 2;
      if (table[mid].first_chunk <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const MultiTensorEntry e = table[lo];
    AdamWScalars t = s;
    // static_cast<float>(1.0 - lr * wd) of the host code: a product and a difference, each rounded in double, then
    // rounded to f32.
    t.decay = __double2float_rn(__dsub_rn(1.0, __dmul_rn(lr, e.weight_decay)));
    t.apply_decay = e.weight_decay != 0.0;
    const int64_t begin = (chunk - e.first_chunk) * kAdamWMultiChunk;
    const int64_t end = begin + kAdamWMultiChunk < e.numel ? begin + kAdamWMultiChunk : e.numel;
    if (four_aligned<kBf16Moments>(e, begin, end)) {
      adamw_chunk_by_four<kBf16Moments>(e, begin, end, t);
      continue;
    }
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      adamw_element<kBf16Moments>(e.p, e.m, e.v, e.g, i, t);
      if (e.copy_kind == kCopyBf16) {
        static_cast<uint16_t*>(e.copy)[i] = f32_to_bf16_bits(e.p[i]);
      } else if (e.copy_kind == kCopyF32) {
        static_cast<float*>(e.copy)[i] = e.p[i];
      }
    }
  }
}

// Sum over the block (kReduceThreads threads) in a fixed tree; thread 0 gets the result.
__device__ double block_sum(double value) {
  __shared__ double scratch[kReduceThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    total = scratch[0];
    for (int w = 1; w < kReduceThreads / 32; ++w) total += scratch[w];
  }
  return total;
}

// partial[c] = sum of squares of chunk c: thread k takes elements k, k + kReduceThreads, ... of the chunk.
__global__ void chunk_squares_kernel(double* partial, const float* x, int64_t n) {
  const int64_t chunk = blockIdx.x;
  const int64_t begin = chunk * kSumOfSquaresChunk;
  const int64_t end = begin + kSumOfSquaresChunk < n ? begin + kSumOfSquaresChunk : n;
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kReduceThreads) {
    const double value = static_cast<double>(x[i]);
    sum += value * value;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) partial[chunk] = sum;
}

// *out = sum of partial[0 .. chunks): thread k takes chunks k, k + kReduceThreads, ..., then the fixed tree.
__global__ void sum_chunks_kernel(double* out, const double* partial, int64_t chunks) {
  double sum = 0.0;
  for (int64_t c = threadIdx.x; c < chunks; c += kReduceThreads) sum += partial[c];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *out = sum;
}

int64_t chunks_of(const Tensor& t) { return (t.numel() + kSumOfSquaresChunk - 1) / kSumOfSquaresChunk; }

// The f32 scalars of ops/cpu/optim.cpp for `params`: the Python-side scalars of torch.optim.adamw in double, then
// rounded to f32, line by line as there.
AdamWScalars scalars_of(const AdamWParams& params) {
  const double step = static_cast<double>(params.step);
  const double decay = 1.0 - params.lr * params.weight_decay;
  const double bias_correction1 = 1.0 - std::pow(params.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(params.beta2, step);
  const double step_size = params.lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);
  AdamWScalars s{};
  s.decay = static_cast<float>(decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - params.beta1);
  s.beta2 = static_cast<float>(params.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - params.beta2);
  s.neg_step_size = static_cast<float>(-step_size);
  s.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  s.eps = static_cast<float>(params.eps);
  s.grad_scale = static_cast<float>(params.grad_scale);
  s.apply_decay = params.weight_decay != 0.0;
  s.scale_grad = params.grad_scale != 1.0;
  return s;
}

constexpr int64_t kMaxMultiBlocks = int64_t(1) << 20;  // blocks loop over further chunks beyond this
constexpr size_t kCachedTables = 4;

// A multi-tensor table: its rows on the host (the cache key, with the stream) and on the device.
struct MultiTable {
  cudaStream_t stream = nullptr;
  std::vector<MultiTensorEntry> entries;
  Tensor device_rows;
  uint64_t last_use = 0;

  bool same_list(const MultiTable& other) const {
    return stream == other.stream && entries.size() == other.entries.size() &&
           std::memcmp(entries.data(), other.entries.data(), entries.size() * sizeof(MultiTensorEntry)) == 0;
  }
};

std::mutex table_mutex;
std::vector<MultiTable> table_cache;  // at most kCachedTables, the least recently used is replaced
uint64_t table_clock = 0;
int64_t tables_built = 0;

// The device copy of `key`'s rows: the cached one when the same list (same rows, same stream) was seen before, else
// a new upload (stream-ordered on key.stream, so kernels queued earlier still read their own tables; a replaced
// table's memory goes back to the stream-ordered pool).
const MultiTensorEntry* cached_table(MultiTable key, Device device) {
  std::lock_guard<std::mutex> lock(table_mutex);
  ++table_clock;
  for (MultiTable& t : table_cache) {
    if (t.same_list(key)) {
      t.last_use = table_clock;
      return static_cast<const MultiTensorEntry*>(t.device_rows.raw_data());
    }
  }
  const size_t bytes = key.entries.size() * sizeof(MultiTensorEntry);
  key.device_rows = Tensor::empty({static_cast<int64_t>(bytes)}, DType::U8, device);
  // The host rows stay alive in the cache entry, so the asynchronous copy may read them later.
  MT_CUDA_CHECK(
      cudaMemcpyAsync(key.device_rows.raw_data(), key.entries.data(), bytes, cudaMemcpyHostToDevice, key.stream));
  key.last_use = table_clock;
  ++tables_built;
  if (table_cache.size() < kCachedTables) {
    table_cache.push_back(std::move(key));
    return static_cast<const MultiTensorEntry*>(table_cache.back().device_rows.raw_data());
  }
  MultiTable* oldest = &table_cache[0];
  for (MultiTable& t : table_cache) {
    if (t.last_use < oldest->last_use) oldest = &t;
  }
  *oldest = std::move(key);
  return static_cast<const MultiTensorEntry*>(oldest->device_rows.raw_data());
}

}  // namespace

void adamw_step(const Stream& stream, const Tensor& param, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                const Tensor& grad, const AdamWParams& params) {
  MT_CHECK(param.dtype() == DType::F32, "adamw_step (CUDA): expected param in f32 but found {}", param.describe());
  const AdamWScalars s = scalars_of(params);
  const int64_t n = param.numel();
  if (n == 0) return;
  const int64_t blocks64 = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < kMaxBlocks ? blocks64 : kMaxBlocks);
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  auto* p = static_cast<float*>(param.raw_data());
  const auto* g = static_cast<const float*>(grad.raw_data());
  if (exp_avg.dtype() == DType::BF16) {
    adamw_kernel<true><<<blocks, kThreads, 0, cu_stream>>>(p, exp_avg.raw_data(), exp_avg_sq.raw_data(), g, n, s);
  } else {
    adamw_kernel<false><<<blocks, kThreads, 0, cu_stream>>>(p, exp_avg.raw_data(), exp_avg_sq.raw_data(), g, n, s);
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

void adamw_step_multi(const Stream& stream, const std::vector<Tensor>& params, const std::vector<Tensor>& exp_avg,
                      const std::vector<Tensor>& exp_avg_sq, const std::vector<Tensor>& grads,
                      const std::vector<Tensor>& compute_copies, const std::vector<double>& weight_decay,
                      const AdamWParams& hyper) {
  constexpr const char* op = "adamw_step_multi (CUDA)";
  MT_CHECK(exp_avg.size() == params.size() && exp_avg_sq.size() == params.size() && grads.size() == params.size() &&
               weight_decay.size() == params.size() &&
               (compute_copies.empty() || compute_copies.size() == params.size()),
           "{}: expected lists of {} entries", op, params.size());
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  MultiTable key;
  key.stream = cu_stream;
  int64_t chunks = 0;
  const bool moments_bf16 = !exp_avg.empty() && exp_avg[0].dtype() == DType::BF16;
  for (size_t i = 0; i < params.size(); ++i) {
    MT_CHECK(params[i].dtype() == DType::F32, "{}: expected params[{}] in f32 but found {}", op, i,
             params[i].describe());
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    MultiTensorEntry e{};
    e.p = static_cast<float*>(params[i].raw_data());
    MT_CHECK(
        exp_avg[i].dtype() == (moments_bf16 ? DType::BF16 : DType::F32) && exp_avg_sq[i].dtype() == exp_avg[i].dtype(),
        "{}: expected every moment in {} but found {} and {}", op, moments_bf16 ? "bf16" : "f32", exp_avg[i].describe(),
        exp_avg_sq[i].describe());
    e.m = exp_avg[i].raw_data();
    e.v = exp_avg_sq[i].raw_data();
    e.g = static_cast<const float*>(grads[i].raw_data());
    e.copy = nullptr;
    e.copy_kind = kNoCopy;
    if (!compute_copies.empty() && compute_copies[i].defined()) {
      const Tensor& c = compute_copies[i];
      MT_CHECK(c.dtype() == DType::BF16 || c.dtype() == DType::F32,
               "{}: expected compute_copies[{}] in bf16 or f32 but found {}", op, i, c.describe());
      e.copy = c.raw_data();
      e.copy_kind = c.dtype() == DType::BF16 ? kCopyBf16 : kCopyF32;
    }
    e.numel = n;
    e.first_chunk = chunks;
    e.weight_decay = weight_decay[i];
    e.moments_bf16 = moments_bf16 ? 1 : 0;
    chunks += (n + kAdamWMultiChunk - 1) / kAdamWMultiChunk;
    key.entries.push_back(e);
  }
  if (key.entries.empty()) return;
  MT_CHECK(key.entries.size() < (size_t(1) << 31), "{}: {} tensors is more than one table holds", op,
           key.entries.size());
  const auto entries = static_cast<int32_t>(key.entries.size());
  const MultiTensorEntry* table = cached_table(std::move(key), stream.device());
  const unsigned blocks = static_cast<unsigned>(chunks < kMaxMultiBlocks ? chunks : kMaxMultiBlocks);
  if (moments_bf16) {
    adamw_multi_kernel<true><<<blocks, kThreads, 0, cu_stream>>>(table, entries, chunks, hyper.lr, scalars_of(hyper));
  } else {
    adamw_multi_kernel<false><<<blocks, kThreads, 0, cu_stream>>>(table, entries, chunks, hyper.lr, scalars_of(hyper));
  }
  MT_CUDA_CHECK(cudaGetLastError());
}

int64_t adamw_multi_tables_built() {
  std::lock_guard<std::mutex> lock(table_mutex);
  return tables_built;
}

std::vector<double> sums_of_squares(const Stream& stream, const std::vector<Tensor>& tensors) {
  std::vector<double> sums(tensors.size(), 0.0);
  if (tensors.empty()) return sums;
  int64_t total_chunks = 0;
  for (const Tensor& t : tensors) {
    MT_CHECK(t.dtype() == DType::F32, "sum_of_squares (CUDA): expected f32 tensors but found {}", t.describe());
    MT_CHECK(chunks_of(t) < (int64_t(1) << 31), "sum_of_squares (CUDA): {} has too many elements", t.describe());
    total_chunks += chunks_of(t);
  }
  const auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  const Device device = stream.device();
  // One buffer: the per-tensor results, then every tensor's chunk sums.
  Tensor buffer = Tensor::empty({static_cast<int64_t>(tensors.size()) + total_chunks}, DType::F64, device);
  double* results = static_cast<double*>(buffer.raw_data());
  double* partial = results + tensors.size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t chunks = chunks_of(tensors[i]);
    if (chunks > 0) {
      chunk_squares_kernel<<<static_cast<unsigned>(chunks), kReduceThreads, 0, cu_stream>>>(
          partial, static_cast<const float*>(tensors[i].raw_data()), tensors[i].numel());
      MT_CUDA_CHECK(cudaGetLastError());
    }
    sum_chunks_kernel<<<1, kReduceThreads, 0, cu_stream>>>(results + i, partial, chunks);
    MT_CUDA_CHECK(cudaGetLastError());
    partial += chunks;
  }
  MT_CUDA_CHECK(cudaMemcpyAsync(sums.data(), results, sums.size() * sizeof(double), cudaMemcpyDeviceToHost, cu_stream));
  MT_CUDA_CHECK(cudaStreamSynchronize(cu_stream));
  return sums;
}

double sum_of_squares(const Stream& stream, const Tensor& x) { return sums_of_squares(stream, {x})[0]; }

}  // namespace moetrain::ops::cuda
