// defines: the per-forward exact-lane checks of wire_checks.h: the wire tensor and the varlen metadata.
#include "exact/wire_checks.h"

#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::exact {

namespace {

std::string found_tensor(const Tensor& t) { return t.defined() ? t.describe() : std::string("missing"); }

// Checks the properties of one host cu_seqlens that do not depend on its partner; `name` is "cu_seqlens_q", ...
void check_cu_seqlens_host(const Tensor& cu, const char* name, int64_t num_tokens, int64_t declared_max_seqlen,
                           int micro_batch) {
  constexpr const char* rule = "varlen metadata";
  MT_CHECK(cu.defined(), "exact: refused: {}: micro-batch {}, {}: declared i32 [D + 1] on the host, found missing",
           rule, micro_batch, name);
  MT_CHECK(cu.dtype() == DType::I32, "exact: refused: {}: micro-batch {}, {}: declared dtype i32, found {}", rule,
           micro_batch, name, cu.describe());
  MT_CHECK(cu.device().is_cpu(),
           "exact: refused: {}: micro-batch {}, {}: declared a host copy on the cpu (device memory is never read), "
           "found {}",
           rule, micro_batch, name, cu.describe());
  MT_CHECK(cu.dim() == 1, "exact: refused: {}: micro-batch {}, {}: declared a 1-D tensor, found {}", rule, micro_batch,
           name, cu.describe());
  MT_CHECK(cu.is_contiguous(), "exact: refused: {}: micro-batch {}, {}: declared contiguous, found {} with strides {}",
           rule, micro_batch, name, cu.describe(), shape_str(cu.strides()));
  const int64_t n = cu.numel();
  MT_CHECK(n >= 2, "exact: refused: {}: micro-batch {}, {}: declared >= 2 entries (one document), found {}", rule,
           micro_batch, name, n);
  const int32_t* c = cu.data<int32_t>();
  MT_CHECK(c[0] == 0, "exact: refused: {}: micro-batch {}, {} entry [0]: declared 0, found {}", rule, micro_batch, name,
           c[0]);
  int64_t longest = 0;
  int64_t longest_at = 1;
  for (int64_t i = 1; i < n; ++i) {
    MT_CHECK(c[i] > c[i - 1],
             "exact: refused: {}: micro-batch {}, {} entry [{}]: declared strictly increasing (> entry [{}] = {}), "
             "found {}",
             rule, micro_batch, name, i, i - 1, c[i - 1], c[i]);
    const int64_t span = int64_t{c[i]} - c[i - 1];
    if (span > longest) {
      longest = span;
      longest_at = i;
    }
  }
  MT_CHECK(c[n - 1] == num_tokens,
           "exact: refused: {}: micro-batch {}, {} entry [{}] (the last): declared the token count {}, found {}", rule,
           micro_batch, name, n - 1, num_tokens, c[n - 1]);
  MT_CHECK(declared_max_seqlen >= longest,
           "exact: refused: {}: micro-batch {}, {} entry [{}]: declared max_seqlen {}, found the span [{}, {}) of {} "
           "tokens",
           rule, micro_batch, name, longest_at, declared_max_seqlen, c[longest_at - 1], c[longest_at], longest);
}

}  // namespace

void check_wire_tensor(const Tensor& t, int stage, int micro_batch) {
  constexpr const char* rule = "wire tensor";
  MT_CHECK(t.defined(), "exact: refused: {}: stage {}, micro-batch {}: declared bf16 [T, H], found missing", rule,
           stage, micro_batch);
  MT_CHECK(t.dtype() == DType::BF16, "exact: refused: {}: stage {}, micro-batch {}: declared dtype bf16, found {}",
           rule, stage, micro_batch, t.describe());
  MT_CHECK(t.dim() == 2, "exact: refused: {}: stage {}, micro-batch {}: declared a 2-D [T, H] tensor, found {}", rule,
           stage, micro_batch, t.describe());
  MT_CHECK(t.is_contiguous(),
           "exact: refused: {}: stage {}, micro-batch {}: declared contiguous, found {} with strides {}", rule, stage,
           micro_batch, t.describe(), shape_str(t.strides()));
}

void check_wire_tensor(const Tensor& t, int stage, int micro_batch, int64_t tokens, int64_t hidden) {
  check_wire_tensor(t, stage, micro_batch);
  MT_CHECK(t.size(0) == tokens && t.size(1) == hidden,
           "exact: refused: wire tensor: stage {}, micro-batch {}: declared shape [{}, {}] (T, H), found {}", stage,
           micro_batch, tokens, hidden, t.describe());
}

void check_varlen_metadata(const Tensor& cu_seqlens_q_host, const Tensor& cu_seqlens_k_host, int64_t num_tokens,
                           int64_t declared_max_seqlen, int micro_batch) {
  check_cu_seqlens_host(cu_seqlens_q_host, "cu_seqlens_q", num_tokens, declared_max_seqlen, micro_batch);
  check_cu_seqlens_host(cu_seqlens_k_host, "cu_seqlens_k", num_tokens, declared_max_seqlen, micro_batch);
  MT_CHECK(cu_seqlens_k_host.numel() == cu_seqlens_q_host.numel(),
           "exact: refused: varlen metadata: micro-batch {}, cu_seqlens_k: declared the {} entries of cu_seqlens_q "
           "(equal q/k spans), found {}",
           micro_batch, cu_seqlens_q_host.numel(), cu_seqlens_k_host.numel());
  const int32_t* q = cu_seqlens_q_host.data<int32_t>();
  const int32_t* k = cu_seqlens_k_host.data<int32_t>();
  for (int64_t i = 0; i < cu_seqlens_q_host.numel(); ++i) {
    MT_CHECK(q[i] == k[i],
             "exact: refused: varlen metadata: micro-batch {}, cu_seqlens_k entry [{}]: declared {} (equal to "
             "cu_seqlens_q: equal q/k spans), found {}",
             micro_batch, i, q[i], k[i]);
  }
}

void check_varlen_metadata(const model::MicroBatch& batch, int64_t declared_max_seqlen, int micro_batch) {
  constexpr const char* rule = "varlen metadata";
  // The token count from the metadata of input_ids (never its bytes).
  MT_CHECK(batch.input_ids.defined() && batch.input_ids.numel() > 0,
           "exact: refused: {}: micro-batch {}, input_ids: declared a non-empty [T], found {}", rule, micro_batch,
           found_tensor(batch.input_ids));
  const int64_t tokens = batch.num_tokens();
  check_varlen_metadata(batch.cu_seqlens_host, batch.cu_seqlens_host, tokens, declared_max_seqlen, micro_batch);

  const Tensor& cu = batch.cu_seqlens;
  const Tensor& host = batch.cu_seqlens_host;
  MT_CHECK(cu.defined(),
           "exact: refused: {}: micro-batch {}, cu_seqlens: declared i32 [{}] beside its host copy, "
           "found missing",
           rule, micro_batch, host.numel());
  MT_CHECK(cu.dtype() == DType::I32 && cu.dim() == 1 && cu.numel() == host.numel() && cu.is_contiguous(),
           "exact: refused: {}: micro-batch {}, cu_seqlens: declared contiguous i32 [{}] like its host copy, found {}",
           rule, micro_batch, host.numel(), cu.describe());
  if (cu.device().is_cpu()) {
    const int32_t* c = cu.data<int32_t>();
    const int32_t* h = host.data<int32_t>();
    for (int64_t i = 0; i < host.numel(); ++i) {
      MT_CHECK(c[i] == h[i],
               "exact: refused: {}: micro-batch {}, cu_seqlens entry [{}]: declared {} (its host copy), found {}", rule,
               micro_batch, i, h[i], c[i]);
    }
  }
}

}  // namespace moetrain::exact
