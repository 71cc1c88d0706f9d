// Tests for the pre-norm decoder layer (as the Qwen3 / Qwen3-MoE families build it) and the single-rank driver: the
// five-stage split with the deferred weight gradients gives the same bytes as the driver, packing does not change a
// document's logits, and the loss is token-weighted across micro-batches.
#include "model/blocks/pre_norm_layer.h"

#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "pipeline/plain_executor.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

std::unique_ptr<CausalLm> golden_model(const std::string& family) {
  return CausalLm::from_hf(testing::test_data_path("golden/" + family));
}

io::SafetensorsReader golden_reference(const std::string& family) {
  return io::SafetensorsReader::open(testing::test_data_path("golden/" + family + "/reference.safetensors"));
}

MicroBatch golden_batch(const std::string& family) {
  const auto ref = golden_reference(family);
  return MicroBatch::from_rows(ref.tensor("input_ids"), ref.tensor("targets"));
}

std::vector<std::vector<float>> gradients_of(const CausalLm& model) {
  std::vector<std::vector<float>> out;
  for (const Tensor& g : model.params().all_grads()) out.push_back(g.to_vector<float>());
  return out;
}

// Runs every layer stage by stage, with all backward_input passes first and the deferred
// backward_weight passes afterwards in reverse order, as a zero-bubble schedule would.
std::vector<std::vector<float>> gradients_with_deferred_weights(const CausalLm& model, const MicroBatch& batch) {
  const int64_t targets = batch.num_targets();
  const size_t n = model.layers().size();
  const double scale = 1.0 / double(targets);
  std::vector<std::unique_ptr<LayerRecord>> records(n);
  Tensor hidden = model.embed_forward(batch);
  for (size_t i = 0; i < n; ++i) {
    const DecoderLayer& layer = *model.layers()[i];
    records[i] = layer.new_record();
    const Dispatch dispatch = layer.stage1_forward(*records[i], hidden, batch);
    const Tensor expert_out = layer.stage3_forward(*records[i], dispatch.rows, dispatch.group_offsets);
    hidden = layer.stage5_forward(*records[i], expert_out);
  }
  EpilogRecord epilog;
  model.head_forward(epilog, hidden, batch, scale);
  Tensor d = model.head_backward_input(epilog, scale);
  for (size_t i = n; i-- > 0;) {
    const DecoderLayer& layer = *model.layers()[i];
    const Tensor d_combined = layer.stage5_backward_input(*records[i], d);
    const Tensor d_dispatched = layer.stage3_backward_input(*records[i], d_combined);
    d = layer.stage1_backward_input(*records[i], d_dispatched);
  }
  model.embed_backward(batch, d);
  for (size_t i = 0; i < n; ++i) {
    model.layers()[i]->stage3_backward_weight(*records[i]);
    model.layers()[i]->stage1_backward_weight(*records[i]);
  }
  model.head_backward_weight(epilog);
  return gradients_of(model);
}

class Qwen3Family : public ::testing::TestWithParam<const char*> {};

TEST_P(Qwen3Family, DeferredWeightGradientsAreBitwiseTheSame) {
  auto model = golden_model(GetParam());
  const MicroBatch batch = golden_batch(GetParam());
  model->params().zero_grads();
  pipeline::forward_backward(*model, {batch});
  const auto reference = gradients_of(*model);
  model->params().zero_grads();
  const auto deferred = gradients_with_deferred_weights(*model, batch);
  ASSERT_EQ(reference.size(), deferred.size());
  for (size_t i = 0; i < reference.size(); ++i) EXPECT_EQ(reference[i], deferred[i]) << model->params().specs()[i].name;
}

TEST_P(Qwen3Family, PackedDocumentLogitsEqualEachDocumentAlone) {
  auto model = golden_model(GetParam());
  const auto ref = golden_reference(GetParam());
  const Tensor ids = ref.tensor("packed.input_ids").clone().view({-1});
  const Tensor targets = ref.tensor("packed.targets").clone().view({-1});
  const Tensor cu = ref.tensor("packed.cu_seqlens").clone();
  ForwardObservation packed;
  pipeline::forward_only(*model, {MicroBatch::packed(ids, targets, cu)}, &packed);
  const auto bounds = cu.to_vector<int32_t>();
  for (size_t d = 0; d + 1 < bounds.size(); ++d) {
    const Tensor doc_ids = ids.slice(bounds[d], bounds[d + 1]).clone();
    const Tensor doc_targets = targets.slice(bounds[d], bounds[d + 1]).clone();
    const std::vector<int32_t> doc_cu{0, bounds[d + 1] - bounds[d]};
    ForwardObservation alone;
    pipeline::forward_only(*model, {MicroBatch::packed(doc_ids, doc_targets, Tensor::from_vector(doc_cu, {2}))}, &alone);
    EXPECT_EQ(alone.logits[0].to_vector<float>(),
              packed.logits[0].slice(bounds[d], bounds[d + 1]).clone().to_vector<float>())
        << "document " << d;
  }
}

TEST_P(Qwen3Family, LossIsTokenWeightedAcrossMicroBatches) {
  auto model = golden_model(GetParam());
  const auto ref = golden_reference(GetParam());
  const Tensor ids = ref.tensor("input_ids").clone();
  const Tensor targets = ref.tensor("targets").clone();
  model->params().zero_grads();
  const StepLoss whole = pipeline::forward_backward(*model, {MicroBatch::from_rows(ids, targets)});
  const auto whole_grads = gradients_of(*model);
  model->params().zero_grads();
  // Row 0 and row 1 as separate micro-batches: unequal counts (row 0 has an ignored target, row 1 four).
  const StepLoss split = pipeline::forward_backward(*model, {MicroBatch::from_rows(ids.slice(0, 1), targets.slice(0, 1)),
                                                   MicroBatch::from_rows(ids.slice(1, 2), targets.slice(1, 2))});
  EXPECT_EQ(whole.num_targets, split.num_targets);
  EXPECT_NEAR(whole.loss, split.loss, 1e-12 * std::abs(whole.loss));
  const auto split_grads = gradients_of(*model);
  for (size_t i = 0; i < whole_grads.size(); ++i) {
    const Tensor a = Tensor::from_vector(split_grads[i], {int64_t(split_grads[i].size())});
    const Tensor b = Tensor::from_vector(whole_grads[i], {int64_t(whole_grads[i].size())});
    EXPECT_LT(testing::relative_error(a, b), 1e-6) << model->params().specs()[i].name;
  }
}

TEST_P(Qwen3Family, RejectsTokenOutsideVocabulary) {
  auto model = golden_model(GetParam());
  Tensor ids = Tensor::from_vector<int32_t>({1, 2, 512}, {1, 3});
  Tensor targets = Tensor::from_vector<int32_t>({2, 3, -100}, {1, 3});
  try {
    pipeline::forward_only(*model, {MicroBatch::from_rows(ids, targets)});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 512 at position 2 is outside the vocabulary [0, 512)"),
              std::string::npos)
        << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, Qwen3Family, ::testing::Values("qwen3", "qwen3_moe"));

}  // namespace
}  // namespace moetrain::model
