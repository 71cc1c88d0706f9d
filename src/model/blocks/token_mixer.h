// defines: TokenMixer, the part of stage 1 that mixes information across the tokens of a document: GQA attention
// (blocks/attention.h) today; latent attention and Gated DeltaNet linear attention implement the same interface, so
// a decoder layer holds whichever its family builds. Its record is the mixer's own (MixerRecord), created by it and
// opaque to the layer.
#pragma once

#include <memory>
#include <string>

#include "core/tensor.h"
#include "model/batch.h"

namespace moetrain::model {

struct MixerRecord {
  virtual ~MixerRecord() = default;
};

class TokenMixer {
 public:
  virtual ~TokenMixer() = default;
  // A fresh record for one micro-batch's forward.
  virtual std::unique_ptr<MixerRecord> new_record() const = 0;
  // x [T, H] (normed) -> [T, H]; the record keeps what the backward needs and a pointer to `batch`, which must outlive
  // the backward.
  virtual Tensor forward(MixerRecord& record, const Tensor& x, const MicroBatch& batch) const = 0;
  // dx [T, H] from d_out [T, H] (in the compute dtype); keeps in the record what backward_weight needs. dx is in the
  // compute dtype, or in f32 under bf16 compute where the mixer sums several projections' input gradients (the
  // layer's norm backward reads either).
  virtual Tensor backward_input(MixerRecord& record, const Tensor& d_out) const = 0;
  // Accumulates the weight gradients and frees the record's tensors.
  virtual void backward_weight(MixerRecord& record) const = 0;
  // Whether forward takes a generation call (a batch with a DecodeCache, model/decode_cache.h). "" when it does, else
  // what it lacks, for the refusal.
  virtual std::string decoding_support() const { return "this token mixer keeps no decoding state yet"; }
};

}  // namespace moetrain::model
