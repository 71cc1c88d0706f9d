// defines: DecodeCache, what generation keeps between its forward calls (docs/generation.md): per token mixer that
// decodes, the keys and values of every sequence's tokens so far (a KV cache), found by the mixer that owns them, so
// other mixers can keep their own per-sequence state the same way later (linear attention's recurrent state). A
// MicroBatch that points at a cache (MicroBatch::decode) is a generation call: the prefill, whose documents are the
// sequences' prompts (document b is sequence b), or a step, one new token per sequence (MicroBatch::decode_step).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace moetrain::model {

// One attention layer's cache: k [B, C, nkv, hd] and v [B, C, nkv, hdv], rows 0 .. length - 1 of sequence b filled.
struct KvCache {
  Tensor k, v;
};

class DecodeCache {
 public:
  enum class Phase { kNone, kPrefill, kStep };

  // `sequences` rows of at most `capacity` tokens each (prompt and generated tokens together).
  DecodeCache(int64_t sequences, int64_t capacity);

  int64_t sequences() const { return sequences_; }
  int64_t capacity() const { return capacity_; }
  Phase phase() const { return phase_; }

  // The prefill: sequence b's prompt is prompt_lengths[b] tokens (1 .. capacity), document b of the call's batch.
  void begin_prefill(const std::vector<int32_t>& prompt_lengths);
  // A step: every sequence gains one token (refused past the capacity, or before the prefill).
  void begin_step();
  // Tokens per sequence, this call's included: i32 [B] on the CPU.
  const Tensor& lengths() const { return lengths_; }

  // The cache of `owner` (the token mixer that fills it), made on first use with these extents and zero rows; a later
  // call must ask for the same extents.
  KvCache& kv(const void* owner, int64_t kv_heads, int64_t head_dim, int64_t value_dim, DType dtype, Device device);
  // Any other per-sequence state of `owner` (Gated DeltaNet's conv inputs and recurrent state): `make` builds it on
  // first use; the owner checks what it finds.
  std::vector<Tensor>& state(const void* owner, const std::function<std::vector<Tensor>()>& make);

 private:
  int64_t sequences_ = 0;
  int64_t capacity_ = 0;
  Phase phase_ = Phase::kNone;
  Tensor lengths_;
  std::map<const void*, KvCache> kv_;
  std::map<const void*, std::vector<Tensor>> state_;
};

}  // namespace moetrain::model
