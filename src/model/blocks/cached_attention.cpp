// defines: attend (model/blocks/cached_attention.h): the prefill's copies of the prompts into the cache, a step's
// appends, and the choice between the training attention and the decoding one.
#include "model/blocks/cached_attention.h"

#include "core/error.h"
#include "model/decode_cache.h"

namespace moetrain::model {

namespace {

// The prefill: document b of the batch is sequence b's prompt; its keys and values become rows 0 .. len - 1 of b's
// cache.
void keep_prompts(KvCache& cache, const Tensor& k, const Tensor& v, const MicroBatch& batch) {
  const int64_t docs = batch.num_documents();
  MT_CHECK(docs == cache.k.size(0),
           "attention (prefill): the batch holds {} documents but the decode cache {} sequences (one prompt each)",
           docs, cache.k.size(0));
  const int32_t* cu = batch.cu_seqlens_host.data<int32_t>();
  for (int64_t b = 0; b < docs; ++b) {
    cache.k.select(b).slice(0, cu[b + 1] - cu[b]).copy_from(k.slice(cu[b], cu[b + 1]));
    cache.v.select(b).slice(0, cu[b + 1] - cu[b]).copy_from(v.slice(cu[b], cu[b + 1]));
  }
}

// A step: token b is sequence b's newest, at row lengths[b] - 1 of its cache.
void append_to_cache(KvCache& cache, const Tensor& k, const Tensor& v, const DecodeCache& decode) {
  MT_CHECK(k.size(0) == decode.sequences(),
           "attention (decode step): the batch holds {} tokens but the decode cache {} sequences (one token each)",
           k.size(0), decode.sequences());
  const int32_t* len = decode.lengths().data<int32_t>();
  for (int64_t b = 0; b < decode.sequences(); ++b) {
    cache.k.select(b).slice(len[b] - 1, len[b]).copy_from(k.slice(b, b + 1));
    cache.v.select(b).slice(len[b] - 1, len[b]).copy_from(v.slice(b, b + 1));
  }
}

}  // namespace

void attend(Stream& stream, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
            const MicroBatch& batch, const ops::AttentionParams& params, const void* owner) {
  if (batch.decode == nullptr) {
    ops::attention_forward(stream, out, lse, q, k, v, batch.cu_seqlens, params);
    return;
  }
  KvCache& cache = batch.decode->kv(owner, k.size(1), k.size(2), v.size(2), k.dtype(), k.device());
  if (batch.decode->phase() == DecodeCache::Phase::kStep) {
    append_to_cache(cache, k, v, *batch.decode);
    ops::attention_decode_forward(stream, out, lse, q, cache.k, cache.v, batch.decode->lengths(), params);
  } else {
    keep_prompts(cache, k, v, batch);
    ops::attention_forward(stream, out, lse, q, k, v, batch.cu_seqlens, params);
  }
}

}  // namespace moetrain::model
