// defines: helpers the block tests share: a parameter store holding a block's own specs (which carry no HF pieces)
// filled with random values, and the message of the moetrain::Error an action throws.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "model/parameter_store.h"
#include "testing/error_message.h"
#include "testing/test_data.h"

namespace moetrain::model::block_testing {

// The specs with one HF piece each, the whole tensor under the parameter's own name: a block declares no pieces
// (its family attaches them), but the store needs pieces that tile.
inline std::vector<ParamSpec> with_whole_pieces(std::vector<ParamSpec> specs) {
  for (ParamSpec& spec : specs) {
    if (spec.pieces.empty()) spec.pieces.push_back({spec.name, spec.shape, 0, {}, {}});
  }
  return specs;
}

// Every matrix N(0, scale^2) and every vector 1 + N(0, 0.2^2) (norm scales that are not all ones), from `seed`.
inline void fill_random(ParameterStore& store, uint64_t seed, double scale) {
  Rng rng(seed);
  for (const ParamSpec& spec : store.specs()) {
    Tensor value = testing::random_tensor(spec.shape, DType::F32, rng, spec.is_matrix() ? scale : 0.2);
    if (!spec.is_matrix()) {
      float* p = value.data<float>();
      for (int64_t i = 0; i < value.numel(); ++i) p[i] += 1.0f;
    }
    store.param(spec.name).copy_from(value);
  }
  store.refresh_compute_weights();
}

// The message of the moetrain::Error that `action` throws; a test failure (and "") when it throws none.
using moetrain::testing::error_message;

inline bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

inline std::vector<float> values(const Tensor& t) { return t.to_vector<float>(); }

}  // namespace moetrain::model::block_testing
