// defines: attend, the attention call of every attention token mixer's forward (GqaAttention, LatentAttention):
// attention over the batch's documents, or in a generation call (MicroBatch::decode, model/decode_cache.h) the same
// after keeping each prompt's keys and values (the prefill), or each sequence's newest token over its cache (a step:
// ops::attention_decode_forward, the training forward's per-query instructions).
#pragma once

#include "core/tensor.h"
#include "model/batch.h"
#include "ops/attention.h"

namespace moetrain::model {

// q [T, nh, hd], k [T, nkv, hd], v [T, nkv, hdv] as ops::attention_forward takes them (after rope and norms: what
// the cache keeps); out, lse as it fills them. `owner` (the calling mixer) finds its cache.
void attend(Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
            const MicroBatch& batch, const ops::AttentionParams& params, const void* owner);

}  // namespace moetrain::model
