// defines: helpers the block tests share: a parameter store holding a block's own specs (which carry no HF pieces)
// filled with random values, the message of the moetrain::Error an action throws, a packed micro-batch, one forward
// and backward of a block, and the checks every sequence block must pass: packed documents give what each gives alone,
// and the weight gradients of micro-batches add up.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "model/batch.h"
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

// A packed micro-batch of the documents that `cu` bounds, token t's id and label t % 7.
inline MicroBatch packed_batch(const std::vector<int32_t>& cu) {
  const int64_t tokens = cu.back();
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) ids[static_cast<size_t>(t)] = static_cast<int32_t>(t % 7);
  return MicroBatch::packed(Tensor::from_vector(ids, {tokens}), Tensor::from_vector(ids, {tokens}),
                            Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}));
}

struct BlockRun {
  Tensor out, dx;
};

// One forward, input backward and weight backward of `block` (its weight gradients added into the store's).
template <class Block>
BlockRun run_block(const Block& block, const Tensor& x, const Tensor& d_out, const MicroBatch& batch) {
  auto record = block.new_record();
  BlockRun run;
  run.out = block.forward(*record, x, batch);
  run.dx = block.backward_input(*record, d_out);
  block.backward_weight(*record);
  return run;
}

// The rows of the packed output and input gradient are those of each document run alone, bitwise (the CPU ops are
// batch-invariant); the weight gradients sum rows in another grouping, so within f32: 1e-6 relative.
template <class Block>
void expect_packed_documents_give_what_each_gives_alone(const Block& block, ParameterStore& store, const Tensor& x,
                                                        const Tensor& d_out, const std::vector<int32_t>& cu) {
  const BlockRun packed = run_block(block, x, d_out, packed_batch(cu));
  std::vector<Tensor> packed_grads;
  for (const Tensor& gr : store.all_grads()) packed_grads.push_back(gr.clone());
  store.zero_grads();
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int32_t begin = cu[d], end = cu[d + 1];
    const MicroBatch alone = packed_batch({0, end - begin});
    const BlockRun run = run_block(block, x.slice(begin, end).clone(), d_out.slice(begin, end).clone(), alone);
    EXPECT_EQ(values(run.out), values(packed.out.slice(begin, end).clone())) << "document " << d;
    EXPECT_EQ(values(run.dx), values(packed.dx.slice(begin, end).clone())) << "document " << d;
  }
  for (size_t i = 0; i < packed_grads.size(); ++i)
    EXPECT_LT(testing::relative_error(store.all_grads()[i], packed_grads[i]), 1e-6) << store.specs()[i].name;
}

// backward_weight adds to the gradients (micro-batches sum into one gradient): two identical micro-batches give
// exactly twice one.
template <class Block>
void expect_weight_gradients_accumulate(const Block& block, ParameterStore& store, const Tensor& x, const Tensor& d_out,
                                        const MicroBatch& batch) {
  run_block(block, x, d_out, batch);
  std::vector<std::vector<float>> once;
  for (const Tensor& gr : store.all_grads()) once.push_back(values(gr));
  run_block(block, x, d_out, batch);
  for (size_t i = 0; i < once.size(); ++i) {
    std::vector<float> twice = once[i];
    for (float& v : twice) v *= 2.0f;
    EXPECT_EQ(values(store.all_grads()[i]), twice) << store.specs()[i].name;
  }
}

}  // namespace moetrain::model::block_testing
