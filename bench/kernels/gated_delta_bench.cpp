// defines: gated_delta_bench, the kernel benchmark of the gated delta rule (ops::gated_delta_rule_forward /
// _backward, the chunked CUDA kernels) at Qwen3.5-35B-A3B's linear-attention dims (16 key heads, 32 value heads, head
// dims 128), 4 documents x 4096 tokens in bf16, against the H200's limits; the sequential CUDA scan timed beside it.
// Prints one line per measurement and one JSON line (grep '^{"bench"').
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

#include "core/device.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "event_timer.h"
#include "ops/cuda/check.h"
#include "ops/cuda/gated_delta.h"
#include "ops/cuda/gated_delta_chunked.h"
#include "ops/cuda/runtime.h"
#include "ops/gated_delta.h"
#include "ops/op_profile.h"

namespace {

using namespace moetrain;

constexpr int64_t kDocs = 4, kDocTokens = 4096, kHk = 16, kHv = 32, kDk = 128, kDv = 128;
constexpr int kWarmup = 3, kIterations = 10;
constexpr double kPeakFlops = 989e12;  // H200 bf16 dense tensor-core peak
constexpr double kPeakBytes = 4.8e12;  // H200 HBM3e

// Multiply-adds of the chunked algorithm's matrix products for one chunk of L tokens and one value head, as the
// kernels compute them (dense L x L products, the triangular masks applied after), FLOPs = 2 x these:
//   forward:  K K^T, w = Tm (beta G K), scores Q K^T: 3 L^2 dk; u = Tm (beta V), scores x U: 2 L^2 dv;
//             U = u - w S, S += (F K)^T U, (G Q) S: 3 L dk dv; Tm by forward substitution: L^3 / 6.
//   backward: the forward's w, u, U, S again: 2 L^2 dk + L^2 dv + 2 L dk dv + L^3 / 6; local dU: L^2 (dk + dv);
//             the reverse state pass (F K) dS, [G Q; -w]^T [dO; dU]: 3 L dk dv; the chunk gradients: Tm^T dU, Y U^T,
//             dO U^T: 3 L^2 dv; K K^T, Q K^T, (dC M) K, [B + B^T; dC M]^T [K; Q]: 5 L^2 dk; dO S^T, Y S^T, K dS,
//             U dS^T: 4 L dk dv.
struct Macs {
  double forward, backward;
};

Macs chunk_macs(double len, double dk, double dv) {
  const double l2 = len * len, ldd = len * dk * dv, l3 = len * len * len / 6.0;
  return {3 * l2 * dk + 2 * l2 * dv + 3 * ldd + l3,
          (2 * l2 * dk + l2 * dv + 2 * ldd + l3) + l2 * (dk + dv) + 3 * ldd + 3 * l2 * dv + 5 * l2 * dk + 4 * ldd};
}

// Standard normal values in bf16 on the GPU.
Tensor random_on_gpu(const Shape& shape, Rng& rng) {
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& x : values) x = static_cast<float>(rng.normal());
  return Tensor::from_vector(values, shape).to(DType::BF16).to(Device::cuda(0));
}

// Mean seconds per call of f over kIterations after kWarmup calls, by CUDA events on the compute stream.
template <typename F>
double seconds_per_call(cudaStream_t stream, F&& f) {
  return bench::seconds_per_call(stream, kWarmup, kIterations, f);
}

// sqrt(sum (a - b)^2 / sum b^2) of two device tensors.
double relative_difference(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()).to(DType::F32), hb = b.to(Device::cpu()).to(DType::F32);
  double diff = 0.0, ref = 0.0;
  for (int64_t i = 0; i < ha.numel(); ++i) {
    const double x = ha.data<float>()[i], y = hb.data<float>()[i];
    diff += (x - y) * (x - y);
    ref += y * y;
  }
  return ref == 0.0 ? 0.0 : std::sqrt(diff / ref);
}

int run() {
  ops::cuda::setup_cuda(0);
  const Device gpu = Device::cuda(0);
  Stream& s = default_stream(gpu);
  const auto stream = static_cast<cudaStream_t>(ops::cuda::stream_handle(s));
  const int64_t T = kDocs * kDocTokens;
  Rng rng(7);
  // q, k L2-normalised as the layer gives them; g = -0.01 - 0.2 |x| (log-decay), beta = sigmoid(x).
  const Tensor qr = random_on_gpu({T, kHk, kDk}, rng);
  const Tensor kr = random_on_gpu({T, kHk, kDk}, rng);
  Tensor q = Tensor::empty(qr.shape(), DType::BF16, gpu), k = Tensor::empty(kr.shape(), DType::BF16, gpu);
  ops::l2norm_forward(s, q, qr, 1e-6f);
  ops::l2norm_forward(s, k, kr, 1e-6f);
  const Tensor v = random_on_gpu({T, kHv, kDv}, rng);
  const Tensor dout = random_on_gpu({T, kHv, kDv}, rng);
  std::vector<float> gv(static_cast<size_t>(T * kHv)), bv(gv.size());
  for (size_t i = 0; i < gv.size(); ++i) {
    gv[i] = static_cast<float>(-0.01 - 0.2 * std::abs(rng.normal()));
    bv[i] = static_cast<float>(1.0 / (1.0 + std::exp(-rng.normal())));
  }
  const Tensor g = Tensor::from_vector(gv, {T, kHv}).to(gpu), beta = Tensor::from_vector(bv, {T, kHv}).to(gpu);
  std::vector<int32_t> cu(kDocs + 1);
  for (int64_t d = 0; d <= kDocs; ++d) cu[d] = static_cast<int32_t>(d * kDocTokens);
  const Tensor cu_seqlens = Tensor::from_vector(cu, {kDocs + 1}).to(gpu);
  const float scale = 1.0f / std::sqrt(float(kDk));

  auto outputs = [&] {
    return std::vector<Tensor>{Tensor::empty(v.shape(), DType::BF16, gpu), Tensor::empty(q.shape(), DType::BF16, gpu),
                               Tensor::empty(q.shape(), DType::BF16, gpu), Tensor::empty(v.shape(), DType::BF16, gpu),
                               Tensor::empty({T, kHv}, DType::F32, gpu),   Tensor::empty({T, kHv}, DType::F32, gpu)};
  };
  std::vector<Tensor> ch = outputs(), sq = outputs();
  const double fwd =
      seconds_per_call(stream, [&] { ops::gated_delta_rule_forward(s, ch[0], q, k, v, g, beta, cu_seqlens, scale); });
  const double bwd = seconds_per_call(stream, [&] {
    ops::gated_delta_rule_backward(s, ch[1], ch[2], ch[3], ch[4], ch[5], dout, q, k, v, g, beta, cu_seqlens, scale);
  });
  const double seq_fwd = seconds_per_call(
      stream, [&] { ops::cuda::gated_delta_rule_sequential_forward(s, sq[0], q, k, v, g, beta, cu_seqlens, scale); });
  const double seq_bwd = seconds_per_call(stream, [&] {
    ops::cuda::gated_delta_rule_sequential_backward(s, sq[1], sq[2], sq[3], sq[4], sq[5], dout, q, k, v, g, beta,
                                                    cu_seqlens, scale);
  });
  // One document of kDocTokens, the shape a training micro-batch of one sequence gives each layer call: the state
  // passes then have one document's (value head, column tile) blocks to spread over the GPU.
  const Tensor cu_one = Tensor::from_vector<int32_t>({0, static_cast<int32_t>(kDocTokens)}, {2}).to(gpu);
  const auto first = [&](const Tensor& t) { return t.slice(0, kDocTokens); };
  std::vector<Tensor> one = {first(ch[0]), first(ch[1]), first(ch[2]), first(ch[3]), first(ch[4]), first(ch[5])};
  const double one_doc = seconds_per_call(stream, [&] {
    ops::gated_delta_rule_forward(s, one[0], first(q), first(k), first(v), first(g), first(beta), cu_one, scale);
    ops::gated_delta_rule_backward(s, one[1], one[2], one[3], one[4], one[5], first(dout), first(q), first(k), first(v),
                                   first(g), first(beta), cu_one, scale);
  });
  MT_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Each kernel of one chunked forward and backward, timed alone: the chunked entry points are called directly, so
  // their per-kernel scopes (gated_delta.*) are the outermost ones and each is charged.
  ops::collect_op_times();
  ops::set_op_profiling(true);
  for (int i = 0; i < kIterations; ++i) {
    ops::cuda::gated_delta_rule_chunked_forward(s, ch[0], q, k, v, g, beta, cu_seqlens, scale);
    ops::cuda::gated_delta_rule_chunked_backward(s, ch[1], ch[2], ch[3], ch[4], ch[5], dout, q, k, v, g, beta,
                                                 cu_seqlens, scale);
  }
  ops::set_op_profiling(false);
  for (const auto& [kernel, seconds] : ops::collect_op_times().by_family) {
    std::printf("kernel %-28s %8.3f ms per forward + backward\n", kernel.c_str(), seconds * 1e3 / kIterations);
  }

  // FLOPs: chunk_macs over every chunk of every document and value head, x2.
  double fwd_flops = 0.0, bwd_flops = 0.0;
  for (int64_t d = 0; d < kDocs; ++d) {
    for (int64_t t = 0; t < kDocTokens; t += ops::cuda::kGdnChunk) {
      const Macs m = chunk_macs(double(std::min<int64_t>(ops::cuda::kGdnChunk, kDocTokens - t)), kDk, kDv);
      fwd_flops += 2.0 * kHv * m.forward;
      bwd_flops += 2.0 * kHv * m.backward;
    }
  }
  // Minimum HBM traffic: every input read once, every output written once (bf16 activations, f32 g / beta / dg /
  // dbeta). Forward: q, k, v, g, beta in, out; backward: q, k, v, dout, g, beta in, dq, dk, dv, dg, dbeta out.
  const double qk = 2.0 * T * kHk * kDk * 2, vv = 2.0 * T * kHv * kDv, gates = 4.0 * T * kHv;
  const double fwd_bytes = qk + vv + 2 * gates + vv;
  const double bwd_bytes = (qk + 2 * vv + 2 * gates) + (qk + vv + 2 * gates);
  const double total = fwd + bwd, flops = fwd_flops + bwd_flops, bytes = fwd_bytes + bwd_bytes;
  const int64_t ws_fwd = ops::cuda::gated_delta_rule_chunked_workspace_bytes(T, kDocs, kHv, kDk, kDv, false);
  const int64_t ws_bwd = ops::cuda::gated_delta_rule_chunked_workspace_bytes(T, kDocs, kHv, kDk, kDv, true);
  const char* names[] = {"out", "dq", "dk", "dv", "dg", "dbeta"};
  double worst = 0.0;
  for (size_t i = 0; i < ch.size(); ++i) {
    const double r = relative_difference(ch[i], sq[i]);
    std::printf("chunked vs sequential %-5s relative difference %.2e\n", names[i], r);
    worst = std::max(worst, r);
  }
  std::printf("gated delta rule, %lld docs x %lld tokens, Hk %lld Hv %lld dk %lld dv %lld, bf16\n",
              static_cast<long long>(kDocs), static_cast<long long>(kDocTokens), static_cast<long long>(kHk),
              static_cast<long long>(kHv), static_cast<long long>(kDk), static_cast<long long>(kDv));
  std::printf("chunked forward    %8.3f ms  %7.2f TFLOP/s (%4.1f%% of 989)  %6.3f TB/s (%4.1f%% of 4.8)\n", fwd * 1e3,
              fwd_flops / fwd / 1e12, 100 * fwd_flops / fwd / kPeakFlops, fwd_bytes / fwd / 1e12,
              100 * fwd_bytes / fwd / kPeakBytes);
  std::printf("chunked backward   %8.3f ms  %7.2f TFLOP/s (%4.1f%% of 989)  %6.3f TB/s (%4.1f%% of 4.8)\n", bwd * 1e3,
              bwd_flops / bwd / 1e12, 100 * bwd_flops / bwd / kPeakFlops, bwd_bytes / bwd / 1e12,
              100 * bwd_bytes / bwd / kPeakBytes);
  std::printf("chunked fwd + bwd  %8.3f ms  %.3e tokens/s  %7.2f TFLOP/s  %6.3f TB/s\n", total * 1e3, T / total,
              flops / total / 1e12, bytes / total / 1e12);
  std::printf("sequential forward %8.3f ms, backward %8.3f ms, fwd + bwd %.3e tokens/s (chunked %.1fx)\n",
              seq_fwd * 1e3, seq_bwd * 1e3, T / (seq_fwd + seq_bwd), (seq_fwd + seq_bwd) / total);
  std::printf("chunked fwd + bwd, one document of %lld tokens: %8.3f ms  %.3e tokens/s\n",
              static_cast<long long>(kDocTokens), one_doc * 1e3, kDocTokens / one_doc);
  std::printf("chunked workspace: forward %.1f MiB, backward %.1f MiB\n", ws_fwd / 1048576.0, ws_bwd / 1048576.0);
  std::printf(
      "{\"bench\":\"gated_delta\",\"tokens\":%lld,\"fwd_ms\":%.4f,\"bwd_ms\":%.4f,\"tokens_per_s\":%.4e,"
      "\"tflops\":%.3f,\"tflops_fwd\":%.3f,\"tflops_bwd\":%.3f,\"tb_per_s\":%.4f,\"seq_fwd_ms\":%.4f,"
      "\"seq_bwd_ms\":%.4f,\"one_doc_ms\":%.4f,\"workspace_fwd_bytes\":%lld,\"workspace_bwd_bytes\":%lld,\"max_rel_"
      "diff_vs_seq\":%.3e}\n",
      static_cast<long long>(T), fwd * 1e3, bwd * 1e3, T / total, flops / total / 1e12, fwd_flops / fwd / 1e12,
      bwd_flops / bwd / 1e12, bytes / total / 1e12, seq_fwd * 1e3, seq_bwd * 1e3, one_doc * 1e3,
      static_cast<long long>(ws_fwd), static_cast<long long>(ws_bwd), worst);
  return 0;
}

}  // namespace

int main() { return run(); }
