// Tests for the CUDA router auxiliary losses (ops/cuda/router_aux.*) through model::router_aux_losses: every
// load-balance variant (micro_batch; sequence with many documents, length-1 ones included; global_batch over three
// micro-batches with device-resident running counts), DeepSeek-V2's device-level balance (alone and beside every
// variant; D = E is the micro_batch variant bitwise) and the z-loss, values and both gradients against the CPU path
// on identical inputs; the values stay on the device until resolve() / resolve_all(); bitwise determinism; no host
// wait.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime.h>
#endif

#include "model/router_loss.h"
#include "ops/cuda/runtime.h"
#include "testing/cuda_compare.h"
#include "testing/gpu.h"
#include "testing/test_data.h"

namespace moetrain {
namespace {

using model::LoadBalanceVariant;
using model::RouterLossSettings;
using model::RouterLossValues;
using testing::on_cpu;
using testing::on_gpu;
using testing::relative_error;

// Both paths evaluate the same f64 expressions (the gradients from the same f64 fractions / lse, counts are
// exact integers); only the order of f64 sums differs (~1e-15 relative). The results are rounded to f32, so they
// may differ by about one f32 ulp (6e-8 relative): 1e-6 leaves room for that and nothing more.
constexpr double kTolerance = 1e-6;

struct Routing {
  Tensor logits, probs, topk;  // on the CPU
};

// T tokens, E experts: random logits, softmax probabilities, top-K by descending logit (ties: lower expert).
Routing make_routing(int64_t T, int64_t E, int64_t K, uint64_t seed) {
  Rng rng(seed);
  Routing r;
  r.logits = testing::random_tensor({T, E}, DType::F32, rng, 2.0);
  r.probs = Tensor::empty({T, E}, DType::F32);
  r.topk = Tensor::empty({T, K}, DType::I32);
  for (int64_t t = 0; t < T; ++t) {
    const float* z = r.logits.data<float>() + t * E;
    double total = 0.0;
    for (int64_t e = 0; e < E; ++e) total += std::exp(double(z[e]));
    std::vector<int> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) r.probs.data<float>()[t * E + e] = float(std::exp(double(z[e])) / total);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return z[a] > z[b]; });
    for (int64_t k = 0; k < K; ++k) r.topk.data<int32_t>()[t * K + k] = order[static_cast<size_t>(k)];
  }
  return r;
}

RouterLossSettings settings(LoadBalanceVariant variant, double lb, double z) {
  RouterLossSettings s;
  s.variant = variant;
  s.load_balance_coef = lb;
  s.z_loss_coef = z;
  s.loss_scale = 1.0 / 777.0;
  s.num_moe_layers = 3;
  return s;
}

struct Result {
  RouterLossValues values;   // resolved
  Tensor d_probs, d_logits;  // on the CPU
};

Result run(const RouterLossSettings& s, int64_t moe_layer, const Routing& r, const std::vector<int32_t>& cu,
           Device device) {
  const Tensor cu_host = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  auto place = [&](const Tensor& t) { return device.is_cpu() ? t : on_gpu(t); };
  Result out;
  Tensor dp, dz;
  out.values =
      model::router_aux_losses(s, moe_layer, place(r.logits), place(r.probs), place(r.topk), place(cu_host), dp, dz);
  if (device.is_cuda()) {
    EXPECT_TRUE(out.values.on_device.defined()) << "CUDA values must stay on the device until resolve()";
    if (out.values.on_device.defined()) {
      EXPECT_TRUE(out.values.on_device.device().is_cuda()) << out.values.on_device.describe();
    }
    EXPECT_TRUE(dp.device().is_cuda() && dz.device().is_cuda()) << dp.describe() << " / " << dz.describe();
  }
  out.values.resolve();
  out.d_probs = on_cpu(dp);
  out.d_logits = on_cpu(dz);
  return out;
}

double relative(double gpu, double cpu) { return cpu == 0.0 ? std::abs(gpu) : std::abs(gpu - cpu) / std::abs(cpu); }

void expect_matches(const Result& gpu, const Result& cpu, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(gpu.values.tokens, cpu.values.tokens);
  EXPECT_LE(relative(gpu.values.load_balance, cpu.values.load_balance), kTolerance)
      << "load balance: gpu " << gpu.values.load_balance << " cpu " << cpu.values.load_balance;
  EXPECT_LE(relative(gpu.values.z_loss, cpu.values.z_loss), kTolerance)
      << "z-loss: gpu " << gpu.values.z_loss << " cpu " << cpu.values.z_loss;
  EXPECT_LE(relative(gpu.values.device_balance, cpu.values.device_balance), kTolerance)
      << "device balance: gpu " << gpu.values.device_balance << " cpu " << cpu.values.device_balance;
  ASSERT_EQ(gpu.d_probs.shape(), cpu.d_probs.shape());
  ASSERT_EQ(gpu.d_logits.shape(), cpu.d_logits.shape());
  EXPECT_LE(relative_error(gpu.d_probs, cpu.d_probs), kTolerance) << "d_probs";
  EXPECT_LE(relative_error(gpu.d_logits, cpu.d_logits), kTolerance) << "d_logits";
}

// cu_seqlens of one document covering T tokens.
std::vector<int32_t> one_document(int64_t T) { return {0, static_cast<int32_t>(T)}; }

// Random document lengths in [1, 9] (about a third of them 1) covering T tokens.
std::vector<int32_t> random_documents(int64_t T, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> cu = {0};
  while (cu.back() < T) {
    const int64_t len = rng.below(3) == 0 ? 1 : 1 + static_cast<int64_t>(rng.below(9));
    cu.push_back(static_cast<int32_t>(std::min<int64_t>(T, cu.back() + len)));
  }
  return cu;
}

struct Case {
  int64_t T, E, K;
};

// E below, at and above multiples of 32 (the kernels' expert tiles), K from 1 to 8, T = 1 and long runs.
const std::vector<Case> kCases = {{1, 4, 1}, {37, 8, 2}, {300, 64, 8}, {1000, 130, 4}, {4099, 32, 6}};

TEST(CudaRouterAux, MicroBatchMatchesCpu) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    const Routing r = make_routing(c.T, c.E, c.K, 11 + static_cast<uint64_t>(c.T));
    const RouterLossSettings s = settings(LoadBalanceVariant::MicroBatch, 0.01, 0.001);
    const std::string what = "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K);
    expect_matches(run(s, 0, r, one_document(c.T), Device::cuda(0)), run(s, 0, r, one_document(c.T), Device::cpu()),
                   what);
  }
}

TEST(CudaRouterAux, SequenceMatchesCpuWithLengthOneDocuments) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    const Routing r = make_routing(c.T, c.E, c.K, 23 + static_cast<uint64_t>(c.T));
    const RouterLossSettings s = settings(LoadBalanceVariant::Sequence, 0.02, 0.0);
    std::vector<std::vector<int32_t>> layouts = {one_document(c.T), random_documents(c.T, 5)};
    if (c.T >= 3) {  // first and last documents of length 1 around one long document
      layouts.push_back({0, 1, static_cast<int32_t>(c.T - 1), static_cast<int32_t>(c.T)});
    }
    std::vector<int32_t> singles(static_cast<size_t>(c.T + 1));  // every document of length 1
    std::iota(singles.begin(), singles.end(), 0);
    layouts.push_back(singles);
    for (size_t l = 0; l < layouts.size(); ++l) {
      const std::string what = "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) +
                               " layout " + std::to_string(l) + " with " + std::to_string(layouts[l].size() - 1) +
                               " documents";
      expect_matches(run(s, 0, r, layouts[l], Device::cuda(0)), run(s, 0, r, layouts[l], Device::cpu()), what);
    }
  }
}

// Three micro-batches of different sizes through MoE layer 1 of 2: the running counts live on the device, match
// the CPU's exactly after each micro-batch, and each micro-batch's values and gradients match.
TEST(CudaRouterAux, GlobalBatchOverThreeMicroBatchesMatchesCpu) {
  MT_REQUIRE_GPU();
  const int64_t E = 48, K = 4;
  RouterLossSettings gpu_s = settings(LoadBalanceVariant::GlobalBatch, 0.05, 0.002);
  RouterLossSettings cpu_s = gpu_s;
  std::vector<Tensor> gpu_counts(2), cpu_counts(2);
  gpu_s.running_counts = &gpu_counts;
  cpu_s.running_counts = &cpu_counts;
  const std::vector<int64_t> tokens = {129, 7, 513};
  for (size_t m = 0; m < tokens.size(); ++m) {
    const Routing r = make_routing(tokens[m], E, K, 100 + m);
    const std::vector<int32_t> cu = random_documents(tokens[m], 7 + m);  // ignored by global_batch
    const Result gpu = run(gpu_s, 1, r, cu, Device::cuda(0));
    const Result cpu = run(cpu_s, 1, r, cu, Device::cpu());
    expect_matches(gpu, cpu, "micro-batch " + std::to_string(m));
    ASSERT_TRUE(gpu_counts[1].defined() && cpu_counts[1].defined());
    EXPECT_TRUE(gpu_counts[1].device().is_cuda()) << gpu_counts[1].describe();
    EXPECT_EQ(gpu_counts[1].to_vector<int32_t>(), cpu_counts[1].to_vector<int32_t>()) << "micro-batch " << m;
    EXPECT_FALSE(gpu_counts[0].defined()) << "layer 0's counts must be left alone";
  }
  const std::vector<int32_t> counts = gpu_counts[1].to_vector<int32_t>();
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), (129 + 7 + 513) * K);
}

TEST(CudaRouterAux, ZLossOnlyMatchesCpuAndLeavesLoadBalanceZero) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    const Routing r = make_routing(c.T, c.E, c.K, 31 + static_cast<uint64_t>(c.T));
    const RouterLossSettings s = settings(LoadBalanceVariant::Sequence, 0.0, 0.003);
    const Result gpu = run(s, 0, r, random_documents(c.T, 3), Device::cuda(0));
    expect_matches(gpu, run(s, 0, r, random_documents(c.T, 3), Device::cpu()), "T=" + std::to_string(c.T));
    EXPECT_EQ(gpu.values.load_balance, 0.0);
    EXPECT_TRUE(testing::same_bytes(gpu.d_probs, Tensor::zeros(gpu.d_probs.shape(), DType::F32)));
  }
}

TEST(CudaRouterAux, LoadBalanceOnlyLeavesZLossZero) {
  MT_REQUIRE_GPU();
  const Routing r = make_routing(65, 16, 2, 41);
  const RouterLossSettings s = settings(LoadBalanceVariant::MicroBatch, 0.01, 0.0);
  const Result gpu = run(s, 0, r, one_document(65), Device::cuda(0));
  expect_matches(gpu, run(s, 0, r, one_document(65), Device::cpu()), "load balance only");
  EXPECT_EQ(gpu.values.z_loss, 0.0);
  EXPECT_TRUE(testing::same_bytes(gpu.d_logits, Tensor::zeros(gpu.d_logits.shape(), DType::F32)));
}

TEST(CudaRouterAux, IsBitwiseDeterministic) {
  MT_REQUIRE_GPU();
  const Routing r = make_routing(2048, 96, 8, 53);
  const std::vector<int32_t> cu = random_documents(2048, 9);
  for (auto variant : {LoadBalanceVariant::MicroBatch, LoadBalanceVariant::Sequence}) {
    const RouterLossSettings s = settings(variant, 0.01, 0.001);
    const Result a = run(s, 0, r, cu, Device::cuda(0)), b = run(s, 0, r, cu, Device::cuda(0));
    EXPECT_EQ(a.values.load_balance, b.values.load_balance);
    EXPECT_EQ(a.values.z_loss, b.values.z_loss);
    EXPECT_TRUE(testing::same_bytes(a.d_probs, b.d_probs));
    EXPECT_TRUE(testing::same_bytes(a.d_logits, b.d_logits));
  }
}

// A document's statistics do not depend on the other documents: appending documents leaves the first ones'
// gradient rows bitwise unchanged.
TEST(CudaRouterAux, SequenceGradientOfADocumentIgnoresOtherDocuments) {
  MT_REQUIRE_GPU();
  const Routing r = make_routing(300, 40, 3, 61);
  const std::vector<int32_t> cu = {0, 1, 120, 121, 300};
  Routing head;
  head.logits = r.logits.slice(0, 121).clone();
  head.probs = r.probs.slice(0, 121).clone();
  head.topk = r.topk.slice(0, 121).clone();
  const RouterLossSettings s = settings(LoadBalanceVariant::Sequence, 0.01, 0.0);
  const Result all = run(s, 0, r, cu, Device::cuda(0));
  const Result part = run(s, 0, head, {0, 1, 120, 121}, Device::cuda(0));
  EXPECT_TRUE(testing::same_bytes(all.d_probs.slice(0, 121).clone(), part.d_probs));
}

#if MOETRAIN_HAS_CUDA  // the CUDA runtime's streams and events (a CPU-only build has no cuda_runtime.h)
// No host wait: with ~tens of milliseconds of memsets queued on the stream first, the call returns while that
// work is still running (an event recorded before the call is not complete yet), and the values are right later.
TEST(CudaRouterAux, ReturnsWithoutWaitingForTheStream) {
  MT_REQUIRE_GPU();
  const Routing r = make_routing(4096, 128, 8, 71);
  const std::vector<int32_t> cu = random_documents(4096, 13);
  const Tensor cu_host = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())});
  const Tensor logits = on_gpu(r.logits), probs = on_gpu(r.probs), topk = on_gpu(r.topk), cu_dev = on_gpu(cu_host);
  std::vector<Tensor> running(1);
  RouterLossSettings s = settings(LoadBalanceVariant::GlobalBatch, 0.01, 0.001);
  s.running_counts = &running;
  Tensor dp, dz;
  model::router_aux_losses(s, 0, logits, probs, topk, cu_dev, dp, dz);  // warm-up: pools, modules
  running[0] = Tensor();
  ops::cuda::synchronize(Device::cuda(0));

  const auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(testing::gpu()));
  const Tensor big = Tensor::empty({int64_t{1} << 30}, DType::F32, Device::cuda(0));  // 4 GiB
  for (int i = 0; i < 20; ++i) {  // ~80 GB of writes: tens of milliseconds on an H200
    ASSERT_EQ(cudaMemsetAsync(big.raw_data(), i, big.nbytes(), stream), cudaSuccess);
  }
  cudaEvent_t queued_before;
  ASSERT_EQ(cudaEventCreate(&queued_before), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(queued_before, stream), cudaSuccess);
  RouterLossValues v = model::router_aux_losses(s, 0, logits, probs, topk, cu_dev, dp, dz);
  const cudaError_t state = cudaEventQuery(queued_before);
  EXPECT_EQ(state, cudaErrorNotReady)
      << "the memsets queued before the call had finished when it returned: the call waited for the stream ("
      << cudaGetErrorString(state) << ")";
  ASSERT_TRUE(v.on_device.defined());
  v.resolve();
  EXPECT_FALSE(v.on_device.defined());
  EXPECT_EQ(cudaEventQuery(queued_before), cudaSuccess) << "resolve() must wait for the values";
  cudaEventDestroy(queued_before);
  std::vector<Tensor> cpu_running(1);
  RouterLossSettings cpu_s = s;
  cpu_s.running_counts = &cpu_running;
  Tensor cdp, cdz;
  const RouterLossValues expected = model::router_aux_losses(cpu_s, 0, r.logits, r.probs, r.topk, cu_host, cdp, cdz);
  EXPECT_LE(relative(v.load_balance, expected.load_balance), kTolerance);
  EXPECT_LE(relative(v.z_loss, expected.z_loss), kTolerance);
  EXPECT_LE(relative_error(on_cpu(dp), cdp), kTolerance);
  EXPECT_LE(relative_error(on_cpu(dz), cdz), kTolerance);
}
#endif  // MOETRAIN_HAS_CUDA

RouterLossSettings with_device_balance(RouterLossSettings s, double coef, int64_t groups) {
  s.device_balance_coef = coef;
  s.device_balance_groups = groups;
  return s;
}

// Every divisor D of E tried below: one group, a few, one per expert (E = 512 > the kernel's 256 threads, so a
// thread takes several groups); group sizes from 1 to E.
std::vector<int64_t> groups_for(int64_t E) {
  std::vector<int64_t> out;
  for (int64_t D : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{5}, int64_t{8}, int64_t{13}, E}) {
    if (E % D == 0 && std::find(out.begin(), out.end(), D) == out.end()) out.push_back(D);
  }
  return out;
}

// The device balance alone (load balance and z-loss off): its value and d_probs against the CPU, the other values 0
// and d_logits untouched (zeros), for every case and several D.
TEST(CudaRouterAux, DeviceBalanceOnlyMatchesCpu) {
  MT_REQUIRE_GPU();
  std::vector<Case> cases = kCases;
  cases.push_back({100, 512, 8});
  for (const Case& c : cases) {
    const Routing r = make_routing(c.T, c.E, c.K, 91 + static_cast<uint64_t>(c.T));
    for (const int64_t D : groups_for(c.E)) {
      const RouterLossSettings s = with_device_balance(settings(LoadBalanceVariant::Sequence, 0.0, 0.0), 0.05, D);
      const std::string what = "T=" + std::to_string(c.T) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) +
                               " D=" + std::to_string(D);
      const std::vector<int32_t> cu = random_documents(c.T, 4);  // ignored: the device balance's set is the batch
      const Result gpu = run(s, 0, r, cu, Device::cuda(0));
      expect_matches(gpu, run(s, 0, r, cu, Device::cpu()), what);
      EXPECT_GT(gpu.values.device_balance, 0.0) << what;
      EXPECT_EQ(gpu.values.load_balance, 0.0) << what;
      EXPECT_EQ(gpu.values.z_loss, 0.0) << what;
      EXPECT_TRUE(testing::same_bytes(gpu.d_logits, Tensor::zeros(gpu.d_logits.shape(), DType::F32))) << what;
    }
  }
}

// Beside every load-balance variant and the z-loss: micro_batch shares the load balance's statistics, sequence
// computes the batch's own, global_batch shares them while its running counts grow (three micro-batches).
TEST(CudaRouterAux, DeviceBalanceBesideEveryVariantMatchesCpu) {
  MT_REQUIRE_GPU();
  const int64_t E = 64, K = 6;
  for (auto variant : {LoadBalanceVariant::MicroBatch, LoadBalanceVariant::Sequence, LoadBalanceVariant::GlobalBatch}) {
    RouterLossSettings gpu_s = with_device_balance(settings(variant, 0.01, 0.001), 0.05, 8);
    RouterLossSettings cpu_s = gpu_s;
    std::vector<Tensor> gpu_counts(1), cpu_counts(1);
    gpu_s.running_counts = &gpu_counts;
    cpu_s.running_counts = &cpu_counts;
    const std::vector<int64_t> tokens = {257, 9, 1031};
    for (size_t m = 0; m < tokens.size(); ++m) {
      const Routing r = make_routing(tokens[m], E, K, 200 + m);
      const std::vector<int32_t> cu = random_documents(tokens[m], 17 + m);
      expect_matches(run(gpu_s, 0, r, cu, Device::cuda(0)), run(cpu_s, 0, r, cu, Device::cpu()),
                     "variant " + std::to_string(static_cast<int>(variant)) + ", micro-batch " + std::to_string(m));
    }
  }
}

// D = E on the GPU: the groups are the experts and the kernels evaluate the value kernel's expressions, so d_probs
// is the micro_batch load balance's bit for bit and the value is the same up to its n / T weighting (1 f32 ulp).
TEST(CudaRouterAux, DeviceBalanceWithOneGroupPerExpertIsTheMicroBatchLoadBalance) {
  MT_REQUIRE_GPU();
  for (const Case& c : kCases) {
    const Routing r = make_routing(c.T, c.E, c.K, 301 + static_cast<uint64_t>(c.T));
    const RouterLossSettings lb = settings(LoadBalanceVariant::MicroBatch, 0.02, 0.0);
    const RouterLossSettings dev = with_device_balance(settings(LoadBalanceVariant::MicroBatch, 0.0, 0.0), 0.02, c.E);
    const Result a = run(lb, 0, r, one_document(c.T), Device::cuda(0));
    const Result b = run(dev, 0, r, one_document(c.T), Device::cuda(0));
    EXPECT_FLOAT_EQ(float(b.values.device_balance), float(a.values.load_balance)) << "T=" << c.T;
    EXPECT_TRUE(testing::same_bytes(a.d_probs, b.d_probs)) << "T=" << c.T;
  }
}

TEST(CudaRouterAux, DeviceBalanceIsBitwiseDeterministic) {
  MT_REQUIRE_GPU();
  const Routing r = make_routing(2048, 96, 8, 57);
  const std::vector<int32_t> cu = random_documents(2048, 11);
  for (const double lb : {0.0, 0.01}) {
    const RouterLossSettings s = with_device_balance(settings(LoadBalanceVariant::Sequence, lb, 0.001), 0.05, 12);
    const Result a = run(s, 0, r, cu, Device::cuda(0)), b = run(s, 0, r, cu, Device::cuda(0));
    EXPECT_EQ(a.values.device_balance, b.values.device_balance);
    EXPECT_EQ(a.values.load_balance, b.values.load_balance);
    EXPECT_TRUE(testing::same_bytes(a.d_probs, b.d_probs));
  }
}

// resolve_all gathers the f32 [3] of several layers with one copy: every value as resolve() reads it alone.
TEST(CudaRouterAux, ResolveAllReadsTheThreeValuesOfEveryLayer) {
  MT_REQUIRE_GPU();
  const RouterLossSettings s = with_device_balance(settings(LoadBalanceVariant::MicroBatch, 0.01, 0.001), 0.05, 4);
  std::vector<RouterLossValues> together, alone;
  for (int64_t layer = 0; layer < 3; ++layer) {
    const Routing r = make_routing(50 + layer, 16, 2, 400 + static_cast<uint64_t>(layer));
    const Tensor cu = on_gpu(Tensor::from_vector<int32_t>({0, static_cast<int32_t>(50 + layer)}, {2}));
    Tensor dp, dz;
    together.push_back(
        model::router_aux_losses(s, layer, on_gpu(r.logits), on_gpu(r.probs), on_gpu(r.topk), cu, dp, dz));
    alone.push_back(together.back());
  }
  model::resolve_all(together);
  for (size_t i = 0; i < together.size(); ++i) {
    alone[i].resolve();
    EXPECT_FALSE(together[i].on_device.defined());
    EXPECT_EQ(together[i].load_balance, alone[i].load_balance) << i;
    EXPECT_EQ(together[i].z_loss, alone[i].z_loss) << i;
    EXPECT_EQ(together[i].device_balance, alone[i].device_balance) << i;
    EXPECT_GT(together[i].device_balance, 0.0) << i;
  }
}

TEST(CudaRouterAux, RejectsTensorsOnDifferentDevices) {
  MT_REQUIRE_GPU();
  const Routing r = make_routing(8, 4, 2, 81);
  const RouterLossSettings s = settings(LoadBalanceVariant::Sequence, 0.01, 0.001);
  Tensor dp, dz;
  const Tensor cu = Tensor::from_vector<int32_t>({0, 3, 8}, {3});
  testing::expect_error(
      [&] { model::router_aux_losses(s, 0, on_gpu(r.logits), on_gpu(r.probs), on_gpu(r.topk), cu, dp, dz); },
      {"cu_seqlens"});
  testing::expect_error(
      [&] { model::router_aux_losses(s, 0, on_gpu(r.logits), r.probs, on_gpu(r.topk), on_gpu(cu), dp, dz); },
      {"probs"});
}

}  // namespace
}  // namespace moetrain
