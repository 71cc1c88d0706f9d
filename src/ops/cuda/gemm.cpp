// defines: the cuBLASLt side of the CUDA gemm (host code): row-major out[M, N] = alpha op(a) op(b) + beta out is run
// as the column-major product out^T [N, M] = op(b)^T op(a)^T, so cuBLASLt's A is our b and its B our a, with no
// copies. Descriptors, layouts and the heuristic's algorithm are cached per problem key.
#include "ops/cuda/gemm.h"

#if MOETRAIN_HAS_CUDA

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "core/error.h"
#include "ops/cuda/cublas_check.h"
#include "ops/cuda/gemm_batch_invariant.h"
#include "ops/cuda/runtime.h"

namespace moetrain::ops::cuda {

namespace {

// Plans kept before the cache is emptied and refilled (a safety valve for workloads with ever-changing shapes; a
// training run uses a few dozen).
constexpr size_t kMaxPlans = 4096;

// Largest power of two (up to 256, cuBLASLt's default assumption) dividing the address: algorithms that need more
// alignment than a buffer has are excluded, and the key keeps plans for differently aligned buffers apart.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if (address == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(256, address & (~address + 1)));
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    default: MT_FAIL("gemm (CUDA): no cuBLASLt type for {} (expected f32 or bf16)", dtype_name(dtype));
  }
}

struct GemmKey {
  int64_t m = 0, n = 0, k = 0;
  bool transpose_a = false, transpose_b = false;
  DType operand_dtype = DType::F32, out_dtype = DType::F32;
  bool accumulate = false;  // beta != 0: C is read
  uint32_t align_a = 0, align_b = 0, align_out = 0;
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& key) const {
    size_t h = 0;
    auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<uint64_t>(key.m));
    mix(static_cast<uint64_t>(key.n));
    mix(static_cast<uint64_t>(key.k));
    mix((uint64_t{key.transpose_a} << 0) | (uint64_t{key.transpose_b} << 1) | (uint64_t{key.accumulate} << 2) |
        (static_cast<uint64_t>(key.operand_dtype) << 8) | (static_cast<uint64_t>(key.out_dtype) << 16));
    mix((uint64_t{key.align_a} << 0) | (uint64_t{key.align_b} << 16) | (uint64_t{key.align_out} << 32));
    return h;
  }
};

// Everything cublasLtMatmul needs besides pointers and scalars. In cuBLASLt's terms: A = our b, B = our a,
// C = D = out.
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr;
  cublasLtMatrixLayout_t layout_b = nullptr;
  cublasLtMatrixLayout_t layout_c = nullptr;
  cublasLtMatmulAlgo_t algo{};

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  // Destruction ignores statuses: it runs while the cache is emptied and must not throw.
  ~GemmPlan() {
    if (layout_c != nullptr) (void)cublasLtMatrixLayoutDestroy(layout_c);
    if (layout_b != nullptr) (void)cublasLtMatrixLayoutDestroy(layout_b);
    if (layout_a != nullptr) (void)cublasLtMatrixLayoutDestroy(layout_a);
    if (desc != nullptr) (void)cublasLtMatmulDescDestroy(desc);
  }
};

struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref != nullptr) (void)cublasLtMatmulPreferenceDestroy(pref);
  }
};

// The descriptors and layouts of `key`, without an algorithm.
std::unique_ptr<GemmPlan> make_descriptors(const GemmKey& key) {
  auto plan = std::make_unique<GemmPlan>();
  const cudaDataType_t operand_type = cuda_type(key.operand_dtype);
  const cudaDataType_t out_type = cuda_type(key.out_dtype);
  // Full f32 accumulation and f32 alpha/beta for every dtype combination: CUBLAS_COMPUTE_32F, never the TF32 or
  // other fast compute types.
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = key.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  const cublasOperation_t op_b = key.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B is our a
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const auto m = static_cast<uint64_t>(key.m), n = static_cast<uint64_t>(key.n), k = static_cast<uint64_t>(key.k);
  // Column-major views of the row-major buffers: row-major [r, c] is column-major [c, r] with leading dimension c.
  // b: [K, N] (no transpose) is column-major [N, K]; b^T stored as [N, K] is column-major [K, N].
  if (key.transpose_b) {
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_a, operand_type, k, n, static_cast<int64_t>(k)));
  } else {
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_a, operand_type, n, k, static_cast<int64_t>(n)));
  }
  // a: [M, K] (no transpose) is column-major [K, M]; a^T stored as [K, M] is column-major [M, K].
  if (key.transpose_a) {
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_b, operand_type, m, k, static_cast<int64_t>(m)));
  } else {
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_b, operand_type, k, m, static_cast<int64_t>(k)));
  }
  // out [M, N] is column-major [N, M].
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_c, out_type, n, m, static_cast<int64_t>(n)));
  return plan;
}

// The heuristic's first `limit` algorithms for `plan`, best first (at least one, or a named error).
std::vector<cublasLtMatmulHeuristicResult_t> heuristic_algorithms(const GemmKey& key, const GemmPlan& plan,
                                                                  cublasLtHandle_t handle, size_t workspace_bytes,
                                                                  int limit) {
  PreferenceGuard preference;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference.pref));
  const uint64_t max_workspace = workspace_bytes;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &max_workspace, sizeof(max_workspace)));
  // cuBLASLt's A, B, C, D alignments: our b, a, out, out.
  const uint32_t alignments[4] = {key.align_b, key.align_a, key.align_out, key.align_out};
  const cublasLtMatmulPreferenceAttributes_t alignment_attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.pref, alignment_attributes[i], &alignments[i],
                                                         sizeof(alignments[i])));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(limit));
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.layout_a, plan.layout_b, plan.layout_c, plan.layout_c,
                                     preference.pref, limit, results.data(), &found);
  MT_CHECK(status != CUBLAS_STATUS_NOT_SUPPORTED && (status != CUBLAS_STATUS_SUCCESS || found > 0),
           "gemm (CUDA): cuBLASLt has no algorithm for out {}[{}, {}] = a{} {} * b{} {} (K = {}, beta {}, alignments "
           "a {} b {} out {} bytes)",
           dtype_name(key.out_dtype), key.m, key.n, key.transpose_a ? "^T" : "", dtype_name(key.operand_dtype),
           key.transpose_b ? "^T" : "", dtype_name(key.operand_dtype), key.k, key.accumulate ? "!= 0" : "== 0",
           key.align_a, key.align_b, key.align_out);
  MT_CUBLAS_CHECK(status);
  results.resize(static_cast<size_t>(found));
  for (const cublasLtMatmulHeuristicResult_t& result : results) MT_CUBLAS_CHECK(result.state);
  return results;
}

std::unique_ptr<GemmPlan> make_plan(const GemmKey& key, cublasLtHandle_t handle, size_t workspace_bytes) {
  std::unique_ptr<GemmPlan> plan = make_descriptors(key);
  plan->algo = heuristic_algorithms(key, *plan, handle, workspace_bytes, 1).front().algo;
  return plan;
}

// The plan cache. Deliberately never destroyed (a process-lifetime object): destroying cuBLASLt descriptors during
// static destruction could race the library's own teardown. The mutex is held across cublasLtMatmul so that a
// plan is never freed (by a refill) while a call is using it; the call only enqueues work.
struct PlanCache {
  std::mutex mutex;
  std::unordered_map<GemmKey, std::unique_ptr<GemmPlan>, GemmKeyHash> plans;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();
  return *cache;
}

// The shape of out = op(a) op(b) (+ beta out); dtypes, beta and alignments come from complete_key.
GemmKey shape_key(const Tensor& out, const Tensor& a, Transpose transpose_a, Transpose transpose_b) {
  GemmKey key;
  key.transpose_a = transpose_a == Transpose::Yes;
  key.transpose_b = transpose_b == Transpose::Yes;
  key.m = out.size(0);
  key.n = out.size(1);
  key.k = key.transpose_a ? a.size(0) : a.size(1);
  return key;
}

void complete_key(GemmKey& key, const Tensor& out, const Tensor& a, const Tensor& b, float beta) {
  key.operand_dtype = a.dtype();
  key.out_dtype = out.dtype();
  key.accumulate = beta != 0.0f;
  key.align_a = alignment_of(a.raw_data());
  key.align_b = alignment_of(b.raw_data());
  key.align_out = alignment_of(out.raw_data());
}

}  // namespace

void gemm(const Stream& stream, const Tensor& out, const Tensor& a, Transpose transpose_a, const Tensor& b,
          Transpose transpose_b, double alpha, double beta) {
  GemmKey key = shape_key(out, a, transpose_a, transpose_b);
  if (key.m == 0 || key.n == 0) return;
  const auto alpha_f = static_cast<float>(alpha);
  const auto beta_f = static_cast<float>(beta);
  if (key.k == 0) {  // an empty sum: out = beta * out, without cuBLAS
    scale_in_place(stream, out, beta_f);
    return;
  }
  // The exact lanes: a layer's forward and input gradient (the rows of a are the batch) on the batch-invariant kernels.
  // A weight gradient (a^T: the reduction runs over the batch itself) stays here, deterministic for its shape.
  if (batch_invariant(stream) && !key.transpose_a) {
    gemm_batch_invariant(stream, out, a, b, transpose_b, alpha, beta);
    return;
  }
  complete_key(key, out, a, b, beta_f);

  auto cu_stream = static_cast<cudaStream_t>(stream_handle(stream));
  auto handle = static_cast<cublasLtHandle_t>(cublaslt_handle());
  size_t workspace_bytes = 0;
  void* workspace = cublaslt_workspace(&workspace_bytes);

  PlanCache& cache = plan_cache();
  const std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.plans.find(key);
  if (it == cache.plans.end()) {
    std::unique_ptr<GemmPlan> plan = make_plan(key, handle, workspace_bytes);
    if (cache.plans.size() >= kMaxPlans) cache.plans.clear();
    it = cache.plans.emplace(key, std::move(plan)).first;
  }
  const GemmPlan& plan = *it->second;
  MT_CUBLAS_CHECK(cublasLtMatmul(handle, plan.desc, &alpha_f, b.raw_data(), plan.layout_a, a.raw_data(), plan.layout_b,
                                 &beta_f, out.raw_data(), plan.layout_c, out.raw_data(), plan.layout_c, &plan.algo,
                                 workspace, workspace_bytes, cu_stream));
}

struct GemmAlternatives::State {
  GemmKey key;
  std::unique_ptr<GemmPlan> plan;  // the descriptors; algo unused
  std::vector<cublasLtMatmulHeuristicResult_t> algorithms;
  Tensor out, a, b;
};

GemmAlternatives::GemmAlternatives(const Tensor& out, const Tensor& a, Transpose transpose_a, const Tensor& b,
                                   Transpose transpose_b, double beta, int limit)
    : state_(std::make_unique<State>()) {
  MT_CHECK(limit >= 1, "GemmAlternatives: expected a limit of at least 1 but found {}", limit);
  state_->key = shape_key(out, a, transpose_a, transpose_b);
  MT_CHECK(state_->key.m > 0 && state_->key.n > 0 && state_->key.k > 0,
           "GemmAlternatives: expected a non-empty problem but found M {} N {} K {}", state_->key.m, state_->key.n,
           state_->key.k);
  complete_key(state_->key, out, a, b, static_cast<float>(beta));
  size_t workspace_bytes = 0;
  (void)cublaslt_workspace(&workspace_bytes);
  state_->plan = make_descriptors(state_->key);
  state_->algorithms = heuristic_algorithms(state_->key, *state_->plan,
                                            static_cast<cublasLtHandle_t>(cublaslt_handle()), workspace_bytes, limit);
  state_->out = out;
  state_->a = a;
  state_->b = b;
}

GemmAlternatives::~GemmAlternatives() = default;

int GemmAlternatives::count() const { return static_cast<int>(state_->algorithms.size()); }

std::string GemmAlternatives::describe(int index) const {
  MT_CHECK(index >= 0 && index < count(), "GemmAlternatives: expected an index below {} but found {}", count(), index);
  const cublasLtMatmulHeuristicResult_t& result = state_->algorithms[static_cast<size_t>(index)];
  int32_t id = 0, split_k = 0;
  uint32_t tile = 0, stages = 0, reduction = 0, swizzle = 0, custom = 0;
  uint16_t cluster = 0;
  size_t written = 0;
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attribute, void* value, size_t bytes) {
    MT_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&result.algo, attribute, value, bytes, &written));
  };
  get(CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id));
  get(CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
  get(CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages));
  get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split_k, sizeof(split_k));
  get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction, sizeof(reduction));
  get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle));
  get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
  get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster));
  return fmt::format(
      "algo {} tile {} stages {} split_k {} reduction {} swizzle {} custom {} cluster {} waves {:.2f} "
      "workspace {}",
      id, tile, stages, split_k, reduction, swizzle, custom, cluster, result.wavesCount, result.workspaceSize);
}

void GemmAlternatives::run(const Stream& stream, int index, double alpha, double beta) const {
  MT_CHECK(index >= 0 && index < count(), "GemmAlternatives: expected an index below {} but found {}", count(), index);
  MT_CHECK((static_cast<float>(beta) != 0.0f) == state_->key.accumulate,
           "GemmAlternatives: expected beta {} 0 (as queried) but found {}",
           state_->key.accumulate ? "!=" : "==", beta);
  size_t workspace_bytes = 0;
  void* workspace = cublaslt_workspace(&workspace_bytes);
  const auto alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const GemmPlan& plan = *state_->plan;
  MT_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(cublaslt_handle()), plan.desc, &alpha_f,
                                 state_->b.raw_data(), plan.layout_a, state_->a.raw_data(), plan.layout_b, &beta_f,
                                 state_->out.raw_data(), plan.layout_c, state_->out.raw_data(), plan.layout_c,
                                 &state_->algorithms[static_cast<size_t>(index)].algo, workspace, workspace_bytes,
                                 static_cast<cudaStream_t>(stream_handle(stream))));
}

}  // namespace moetrain::ops::cuda

#endif  // MOETRAIN_HAS_CUDA
