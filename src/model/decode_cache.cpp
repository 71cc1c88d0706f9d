// defines: DecodeCache (model/decode_cache.h): the phases of a generation and the per-mixer KV caches.
#include "model/decode_cache.h"

#include "core/error.h"

namespace moetrain::model {

DecodeCache::DecodeCache(int64_t sequences, int64_t capacity)
    : sequences_(sequences), capacity_(capacity), lengths_(Tensor::zeros({sequences}, DType::I32)) {
  MT_CHECK(sequences >= 1 && capacity >= 1 && capacity <= INT32_MAX,
           "decode cache: expected >= 1 sequences of capacity in [1, 2^31 - 1] but found {} of {}", sequences,
           capacity);
}

void DecodeCache::begin_prefill(const std::vector<int32_t>& prompt_lengths) {
  MT_CHECK(phase_ == Phase::kNone, "decode cache: the prefill runs once, before any step");
  MT_CHECK(static_cast<int64_t>(prompt_lengths.size()) == sequences_,
           "decode cache: expected {} prompt lengths (one per sequence) but found {}", sequences_,
           prompt_lengths.size());
  int32_t* len = lengths_.data<int32_t>();
  for (int64_t b = 0; b < sequences_; ++b) {
    const int32_t n = prompt_lengths[static_cast<size_t>(b)];
    MT_CHECK(n >= 1 && n <= capacity_, "decode cache: prompt {} has {} tokens, expected 1 .. {} (the capacity)", b, n,
             capacity_);
    len[b] = n;
  }
  phase_ = Phase::kPrefill;
}

void DecodeCache::begin_step() {
  MT_CHECK(phase_ != Phase::kNone, "decode cache: a step needs the prefill first");
  int32_t* len = lengths_.data<int32_t>();
  for (int64_t b = 0; b < sequences_; ++b) {
    MT_CHECK(len[b] < capacity_, "decode cache: sequence {} already holds {} tokens, the capacity", b, len[b]);
  }
  for (int64_t b = 0; b < sequences_; ++b) ++len[b];
  phase_ = Phase::kStep;
}

KvCache& DecodeCache::kv(const void* owner, int64_t kv_heads, int64_t head_dim, int64_t value_dim, DType dtype,
                         Device device) {
  const Shape k_shape{sequences_, capacity_, kv_heads, head_dim}, v_shape{sequences_, capacity_, kv_heads, value_dim};
  auto [it, made] = kv_.try_emplace(owner);
  KvCache& cache = it->second;
  if (made) {
    cache.k = Tensor::zeros(k_shape, dtype, device);
    cache.v = Tensor::zeros(v_shape, dtype, device);
  }
  MT_CHECK(cache.k.shape() == k_shape && cache.v.shape() == v_shape && cache.k.dtype() == dtype &&
               cache.k.device() == device,
           "decode cache: a mixer asked for k {} / v {} {} on {} but its cache holds {} / {}", shape_str(k_shape),
           shape_str(v_shape), dtype_name(dtype), device.str(), cache.k.describe(), cache.v.describe());
  return cache;
}

std::vector<Tensor>& DecodeCache::state(const void* owner, const std::function<std::vector<Tensor>()>& make) {
  auto [it, made] = state_.try_emplace(owner);
  if (made) it->second = make();
  return it->second;
}

}  // namespace moetrain::model
