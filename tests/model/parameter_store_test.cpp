// Tests for model/parameter_store: HF name mapping, loading checks, export round trip.
#include "model/parameter_store.h"

#include <filesystem>
#include <fstream>
#include <limits>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "model/family.h"
#include "model/model_config.h"
#include "testing/cuda_compare.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

std::vector<std::pair<std::string, Tensor>> golden_weights(const std::string& family) {
  const auto reader = io::SafetensorsReader::open(testing::test_data_path("golden/" + family + "/model.safetensors"));
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& name : reader.names()) out.emplace_back(name, reader.tensor(name).clone());
  return out;
}

// A model folder with the golden config and the given weights.
std::string write_model_dir(const std::string& family, const std::vector<std::pair<std::string, Tensor>>& weights) {
  const std::string dir = testing::make_temp_dir("model_" + family);
  std::filesystem::copy_file(testing::test_data_path("golden/" + family + "/config.json"), dir + "/config.json");
  io::write_safetensors(dir + "/model.safetensors", weights);
  return dir;
}

std::string load_error(const std::string& dir) {
  try {
    CausalLm::from_hf(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// set_compute_in_f32 changes only a matrix's compute copy: under f32 compute the master is what compute reads, so
// nothing changes; a 1-D tensor has no copy and is refused by name. (The bf16 copies it drops and makes again are
// checked on the GPU: CudaResidualStream.F32StreamReadsTheEmbeddingMasterTable.)
TEST(ParameterStore, ComputeInF32ChangesOnlyAMatrixsCopy) {
  const auto model = CausalLm::from_hf(testing::test_data_path("golden/qwen3"));
  ParameterStore& store = model->params();
  const std::string table = store.find_role(ParamRole::Embedding)->name;
  store.set_compute_in_f32(table, true);
  EXPECT_EQ(store.weight(table).data<float>(), store.param(table).data<float>());
  store.set_compute_in_f32(table, false);
  EXPECT_EQ(store.weight(table).data<float>(), store.param(table).data<float>());
  const std::string norm = store.find_role(ParamRole::Norm)->name;
  testing::expect_error([&] { store.set_compute_in_f32(norm, true); }, {"'" + norm + "' is not a matrix (1 dims)"});
  testing::expect_error([&] { store.set_compute_in_f32("no.such.weight", true); }, {"no parameter 'no.such.weight'"});
}

TEST(ParameterStore, StacksExpertsAndFusesGateUp) {
  const auto config = model::load_model_config(testing::test_data_path("golden/qwen3_moe"));
  const auto model = CausalLm::from_hf(testing::test_data_path("golden/qwen3_moe"));
  const Tensor gate_up = model->params().param("layers.1.experts.gate_up");
  EXPECT_EQ(gate_up.shape(), (Shape{8, 96, 64}));
  const auto reader = io::SafetensorsReader::open(testing::test_data_path("golden/qwen3_moe"));
  const Tensor up3 = reader.tensor("model.layers.1.mlp.experts.3.up_proj.weight");
  const float* ours = gate_up.data<float>() + (3 * 96 + 48) * 64;
  const float* theirs = up3.data<float>();
  for (int64_t i = 0; i < up3.numel(); ++i) ASSERT_EQ(ours[i], theirs[i]) << i;
  EXPECT_FALSE(model->params().contains("layers.0.router"));  // mlp_only_layers = [0]
  EXPECT_TRUE(model->params().contains("layers.0.mlp.gate_up"));
}

TEST(ParameterStore, ExportRoundTripsEveryHfTensor) {
  const auto model = CausalLm::from_hf(testing::test_data_path("golden/qwen3_moe"));
  const auto exported = model->params().export_hf();
  const auto original = golden_weights("qwen3_moe");
  ASSERT_EQ(exported.size(), original.size());
  std::map<std::string, Tensor> by_name(original.begin(), original.end());
  for (const auto& [name, tensor] : exported) {
    ASSERT_TRUE(by_name.count(name)) << name;
    EXPECT_EQ(tensor.shape(), by_name[name].shape()) << name;
    EXPECT_EQ(tensor.to_vector<float>(), by_name[name].to_vector<float>()) << name;
  }
}

TEST(ParameterStore, ReportsEveryMissingTensor) {
  auto weights = golden_weights("qwen3");
  std::erase_if(weights, [](const auto& w) {
    return w.first == "model.norm.weight" || w.first == "model.layers.1.mlp.up_proj.weight";
  });
  const std::string message = load_error(write_model_dir("qwen3", weights));
  EXPECT_NE(message.find("missing tensor 'model.norm.weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("missing tensor 'model.layers.1.mlp.up_proj.weight'"), std::string::npos) << message;
}

TEST(ParameterStore, RejectsWrongShapeForConfig) {
  auto weights = golden_weights("qwen3");
  for (auto& [name, tensor] : weights) {
    if (name == "model.layers.0.self_attn.q_proj.weight") tensor = Tensor::zeros({64, 64}, DType::F32);
  }
  const std::string message = load_error(write_model_dir("qwen3", weights));
  EXPECT_NE(
      message.find("'model.layers.0.self_attn.q_proj.weight' has shape [64, 64] but the config implies [128, 64]"),
      std::string::npos)
      << message;
}

TEST(ParameterStore, RejectsUnexpectedTensor) {
  auto weights = golden_weights("qwen3");
  weights.emplace_back("model.layers.7.mlp.gate_proj.weight", Tensor::zeros({2, 2}, DType::F32));
  const std::string message = load_error(write_model_dir("qwen3", weights));
  EXPECT_NE(message.find("unexpected tensor 'model.layers.7.mlp.gate_proj.weight'"), std::string::npos) << message;
}

TEST(ParameterStore, LoadsBf16CheckpointsByConverting) {
  auto weights = golden_weights("qwen3");
  for (auto& [name, tensor] : weights) tensor = tensor.to(DType::BF16);
  const auto model = CausalLm::from_hf(write_model_dir("qwen3", weights));
  const Tensor norm = model->params().param("final_norm");
  const Tensor expected = golden_weights("qwen3").front().second;  // sorted: lm_head.weight first
  EXPECT_EQ(model->params().param("lm_head").to_vector<float>(),
            expected.to(DType::BF16).to(DType::F32).to_vector<float>());
  EXPECT_EQ(norm.dtype(), DType::F32);
}

// Issue 20: `convert --hf` (CausalLm::from_hf) imported Inf/NaN weights without a word; each is now a problem naming
// the tensor and where, in f32 and in bf16, before anything is copied.
TEST(ParameterStore, RejectsNonFiniteWeightsNamingTheTensor) {
  for (const DType dtype : {DType::F32, DType::BF16}) {
    auto weights = golden_weights("qwen3");
    for (auto& [name, tensor] : weights) {
      tensor = tensor.to(dtype);
      if (name == "model.layers.1.mlp.down_proj.weight") {
        Tensor f = tensor.to(DType::F32);
        f.data<float>()[5] = std::numeric_limits<float>::infinity();
        tensor = f.to(dtype);
      } else if (name == "model.norm.weight") {
        Tensor f = tensor.to(DType::F32);
        f.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
        tensor = f.to(dtype);
      }
    }
    const std::string message = load_error(write_model_dir("qwen3", weights));
    EXPECT_NE(message.find("'model.layers.1.mlp.down_proj.weight' holds a non-finite value (inf) at flat index 5"),
              std::string::npos)
        << dtype_name(dtype) << ": " << message;
    EXPECT_NE(message.find("'model.norm.weight' holds a non-finite value (nan) at flat index 0"), std::string::npos)
        << dtype_name(dtype) << ": " << message;
  }
}

TEST(ParameterStore, SeededInitIsIndependentOfOrder) {
  const auto config = model::load_model_config(testing::test_data_path("golden/qwen3_moe"));
  ParameterStore a(config.family->param_specs(config));
  auto reversed = config.family->param_specs(config);
  std::reverse(reversed.begin(), reversed.end());
  ParameterStore b(reversed);
  a.init_random(7, 0.02);
  b.init_random(7, 0.02);
  for (const auto& spec : a.specs()) {
    EXPECT_EQ(a.param(spec.name).to_vector<float>(), b.param(spec.name).to_vector<float>()) << spec.name;
  }
}

// init_random fills large tensors in parallel chunks; every value is still the one the tensor's own
// stream gives in one sequential pass (normal() takes exactly two draws per value).
TEST(ParameterStore, ParallelInitEqualsOneSequentialStream) {
  const Shape shape{300, 1000};  // several 65,536-value chunks
  ParameterStore store({single_piece_spec("w", shape, ParamRole::Dense, -1, "w")});
  store.init_random(11, 0.5);
  Rng rng = Rng::for_key(11, "w");
  const std::vector<float> values = store.param("w").to_vector<float>();
  for (size_t i = 0; i < values.size(); ++i) {
    const auto expected = static_cast<float>(rng.normal() * 0.5);
    ASSERT_EQ(values[i], expected) << "value " << i;
  }
}

// Gated DeltaNet's A_log starts as transformers starts it, log(U(0.01, 16)) per value head, and dt_bias at 1.
TEST(ParameterStore, GatedDeltaNetDecaysStartAsTransformersStartsThem) {
  const auto config = model::load_model_config(testing::test_data_path("golden/qwen3_5"));
  ParameterStore store(config.family->param_specs(config));
  store.init_random(5, 0.02);
  int checked = 0;
  for (const auto& spec : store.specs()) {
    const std::vector<float> values = store.param(spec.name).to_vector<float>();
    if (spec.fp32_pin == "A_log") {
      EXPECT_EQ(spec.init, ParamInit::LogUniform) << spec.name;
      Rng rng = Rng::for_key(5, spec.name);
      for (float v : values) {
        EXPECT_EQ(v, static_cast<float>(std::log(0.01 + (16.0 - 0.01) * rng.uniform()))) << spec.name;
        EXPECT_GE(v, std::log(0.01f) - 1e-6f) << spec.name;
        EXPECT_LT(v, std::log(16.0f)) << spec.name;
      }
      EXPECT_NE(values.front(), values.back()) << spec.name << ": one value per head, drawn apart";
      ++checked;
    } else if (spec.fp32_pin == "dt_bias") {
      for (float v : values) EXPECT_EQ(v, 1.0f) << spec.name;
    }
  }
  EXPECT_EQ(checked, 3);  // the golden model's three linear-attention layers
}

TEST(ParameterStore, F32ComputeReadsTheMastersAndBf16ComputeNeedsCuda) {
  const Shape shape{4, 3};
  ParameterStore store({single_piece_spec("w", shape, ParamRole::Dense, -1, "w")});
  EXPECT_EQ(store.weight("w").raw_data(), store.param("w").raw_data());
  try {
    ParameterStore bf16({single_piece_spec("w", shape, ParamRole::Dense, -1, "w")}, Device::cpu(), DType::BF16);
    ADD_FAILURE() << "bf16 compute on the CPU was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compute dtype bf16 on cpu is not supported"), std::string::npos) << e.what();
  }
}

// A gradient left to its first writer: begin_accumulation zeroes every other gradient and leaves it as it is (its
// writer's first write replaces it); take_first_write says so once; end_accumulation zeroes one nobody wrote;
// zero_grads zeroes everything and leaves nothing pending.
TEST(ParameterStore, FirstWritesLeaveOnlyTheirGradientsUnzeroed) {
  const Shape shape{2, 3};
  ParameterStore store({single_piece_spec("bank", shape, ParamRole::ExpertBank, 0, "bank"),
                        single_piece_spec("dense", shape, ParamRole::Dense, 0, "dense")});
  const auto fill = [&](float v) {
    for (const char* name : {"bank", "dense"})
      store.grad(name).copy_from(Tensor::from_vector(std::vector<float>(6, v), shape));
  };
  const auto all_equal = [&](const char* name, float v) {
    for (float x : store.grad(name).to_vector<float>()) {
      if (x != v) return false;
    }
    return true;
  };
  const size_t bank = store.overwrite_on_first_write("bank");
  EXPECT_EQ(store.overwrite_on_first_write("bank"), bank) << "a block built twice registers the same slot";
  EXPECT_FALSE(store.take_first_write(bank)) << "nothing is pending before a step";

  fill(7.0f);
  store.begin_accumulation();
  EXPECT_TRUE(all_equal("bank", 7.0f)) << "left to its writer";
  EXPECT_TRUE(all_equal("dense", 0.0f));
  EXPECT_TRUE(store.take_first_write(bank));
  EXPECT_FALSE(store.take_first_write(bank)) << "only the first write overwrites";
  store.end_accumulation();
  EXPECT_TRUE(all_equal("bank", 7.0f)) << "written this step: kept";

  store.begin_accumulation();
  store.end_accumulation();
  EXPECT_TRUE(all_equal("bank", 0.0f)) << "no writer this step: zeroed at its end";

  fill(5.0f);
  store.begin_accumulation();
  store.zero_grads();
  EXPECT_TRUE(all_equal("bank", 0.0f));
  EXPECT_FALSE(store.take_first_write(bank)) << "zero_grads leaves nothing to a first write";

  try {
    store.overwrite_on_first_write("missing");
    ADD_FAILURE() << "a first writer of a parameter the store lacks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no parameter 'missing'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moetrain::model
