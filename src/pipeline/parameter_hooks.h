// defines: ParameterHooks, what an executor calls around each part of the model it runs (the embedding, a decoder
// layer, the final norm and head), so that sharded data parallelism (train/fully_sharded.h) can gather a part's
// parameters just before it runs, free them after, and reduce-scatter its gradients once its backward is done.
#pragma once

#include <cstdint>

namespace moetrain::pipeline {

struct ModelPart {
  enum class Kind { Embedding, Layer, Head };  // Head: the final norm, the LM head and the loss
  Kind kind = Kind::Layer;
  int64_t layer = -1;  // Layer only: the decoder layer's index
  static ModelPart embedding() { return {Kind::Embedding, -1}; }
  static ModelPart decoder_layer(int64_t index) { return {Kind::Layer, index}; }
  static ModelPart head() { return {Kind::Head, -1}; }
};

class ParameterHooks {
 public:
  virtual ~ParameterHooks() = default;
  // Around a part's forward. A training step's head runs its backward right after its forward: the executor then
  // calls before_backward(Head) without after_forward(Head) in between.
  virtual void before_forward(const ModelPart& part) = 0;
  virtual void after_forward(const ModelPart& part) = 0;
  // Around a part's backward, input and weight gradients both.
  virtual void before_backward(const ModelPart& part) = 0;
  virtual void after_backward(const ModelPart& part) = 0;
};

}  // namespace moetrain::pipeline
