// Tests for the Qwen3.5 family's checkpoint names (Family::checkpoint_tensor_name, CausalLm::load_hf_weights): a
// released multimodal checkpoint (the text model under "model.language_model.", a vision tower under "model.visual.",
// multi-token-prediction layers under "mtp.", the config wrapped in text_config) loads the same weights as the text
// checkpoint it wraps; a tensor outside those prefixes is still refused, and a tensor given under both names too.
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_fields.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

using nlohmann::json;
using Tensors = std::vector<std::pair<std::string, Tensor>>;

const std::string kGolden = "golden/qwen3_5";

// The golden text checkpoint's tensors, as a released multimodal checkpoint names them, plus `extra`.
Tensors wrapped_tensors(const Tensors& extra) {
  const io::SafetensorsReader text = io::SafetensorsReader::open(testing::test_data_path(kGolden));
  Tensors out;
  for (const std::string& name : text.names()) {
    const std::string wrapped =
        name.starts_with("model.") ? "model.language_model." + name.substr(std::string("model.").size()) : name;
    out.emplace_back(wrapped, text.tensor(name).clone());
  }
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

// A model folder: the golden config wrapped as the released "qwen3_5" one, and `tensors`.
std::string multimodal_folder(const std::string& tag, const Tensors& tensors) {
  const std::string dir = testing::make_temp_dir(tag);
  json text = io::read_json_object(testing::test_data_path(kGolden + "/config.json"));
  const json wrapper = {{"model_type", "qwen3_5"},
                        {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                        {"text_config", text},
                        {"vision_config", {{"model_type", "qwen3_5"}, {"depth", 2}, {"hidden_size", 32}}}};
  std::ofstream(dir + "/config.json") << wrapper.dump(2);
  io::write_safetensors(dir + "/model.safetensors", tensors);
  return dir;
}

// A tensor of `shape` holding `value` everywhere.
Tensor filled(const Shape& shape, float value) {
  return Tensor::from_vector(std::vector<float>(static_cast<size_t>(shape_numel(shape)), value), shape);
}

Tensors tower_and_mtp() {
  return {{"model.visual.blocks.0.attn.qkv.weight", filled({96, 32}, 0.5f)},
          {"model.visual.merger.linear_fc1.weight", filled({8, 8}, 1.0f)},
          {"mtp.fc.weight", filled({64, 128}, 2.0f)}};
}

// Loading the folder fails with an error that names `needle`.
void expect_load_error(const std::string& dir, const std::string& needle) {
  testing::expect_error([&] { CausalLm::from_hf(dir); }, needle);
}

TEST(Qwen3_5Checkpoint, AMultimodalCheckpointLoadsTheWeightsOfTheTextModelItWraps) {
  const auto text = CausalLm::from_hf(testing::test_data_path(kGolden));
  const auto wrapped = CausalLm::from_hf(multimodal_folder("qwen3_5_multimodal", wrapped_tensors(tower_and_mtp())));
  EXPECT_EQ(wrapped->config().model_type, text->config().model_type);
  const Tensors want = text->params().export_hf(), got = wrapped->params().export_hf();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second.to_vector<float>(), want[i].second.to_vector<float>()) << want[i].first;
  }
}

TEST(Qwen3_5Checkpoint, ATensorOutsideTheKnownPrefixesIsStillRefused) {
  expect_load_error(
      multimodal_folder("qwen3_5_stray", wrapped_tensors({{"model.projector.weight", filled({4}, 1.0f)}})),
      "unexpected tensor 'model.projector.weight'");
}

TEST(Qwen3_5Checkpoint, ATensorUnderBothNamesIsRefused) {
  expect_load_error(multimodal_folder("qwen3_5_twice", wrapped_tensors({{"model.norm.weight", filled({64}, 1.0f)}})),
                    "tensor 'model.norm.weight' given twice");
}

TEST(Qwen3_5Checkpoint, AMissingTextTensorIsNamedAsTheTextModelReadsIt) {
  Tensors tensors = wrapped_tensors({});
  std::erase_if(tensors, [](const auto& t) { return t.first == "model.language_model.norm.weight"; });
  expect_load_error(multimodal_folder("qwen3_5_missing", tensors), "missing tensor 'model.norm.weight'");
}

}  // namespace
}  // namespace moetrain::model
