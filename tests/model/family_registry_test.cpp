// Tests for the family registry (model/family.h): the families are registered under their folder names and serve
// their model_type, an unknown type is refused listing the supported ones, and every registered family's parameter
// layout for its golden config.json is one the engine above the families can rely on: roles and layers that agree
// with the names, one embedding, at most one head, one final norm, the MoE parameters on MoE layers only, unique HF
// names, and pieces that tile each parameter.
#include "model/family.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "model/model_config.h"
#include "model/parameter_store.h"
#include "testing/test_data.h"

namespace moetrain::model {
namespace {

std::vector<std::string> registered_names() {
  std::vector<std::string> names;
  for (const Family* f : registered_families()) names.push_back(f->name());
  return names;
}

TEST(FamilyRegistry, RegistersQwen3AndQwen3MoeUnderTheirFolderNames) {
  const std::vector<std::string> names = registered_names();
  const std::set<std::string> unique(names.begin(), names.end());
  EXPECT_EQ(unique.size(), names.size()) << "a family is registered twice";
  for (const char* name : {"qwen3", "qwen3_moe"}) {
    EXPECT_TRUE(unique.count(name)) << name;
    const Family& family = family_for(name, "test/config.json");
    EXPECT_EQ(family.name(), name);
  }
  // Every model_type is served by exactly one family, and each is listed among the supported types.
  std::map<std::string, int> served;
  for (const Family* f : registered_families())
    for (const std::string& type : f->model_types()) {
      ++served[type];
      EXPECT_EQ(&family_for(type, "test/config.json"), f) << type;
      EXPECT_NE(supported_model_types().find(type), std::string::npos) << type;
    }
  for (const auto& [type, count] : served) EXPECT_EQ(count, 1) << type;
}

TEST(FamilyRegistry, UnknownModelTypeListsTheSupportedTypes) {
  try {
    family_for("llama", "models/tiny/config.json");
    FAIL() << "an unknown model_type was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("models/tiny/config.json: model_type 'llama' is not supported"), std::string::npos) << m;
    EXPECT_NE(m.find("(supported: " + supported_model_types() + ")"), std::string::npos) << m;
    for (const Family* f : registered_families())
      for (const std::string& type : f->model_types()) EXPECT_NE(m.find(type), std::string::npos) << type;
  }
}

// The decoder layer a parameter's name places it in ("layers.<n>." prefix), or -1.
int64_t layer_in_name(const std::string& name) {
  const std::string prefix = "layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size()) return -2;  // malformed: fails every check below
  return std::stoll(name.substr(prefix.size(), dot - prefix.size()));
}

class RegisteredFamily : public ::testing::TestWithParam<std::string> {};

TEST_P(RegisteredFamily, GoldenLayoutHasConsistentRolesLayersAndTilingPieces) {
  const ModelConfig config = load_model_config(testing::test_data_path("golden/" + GetParam() + "/config.json"));
  ASSERT_EQ(config.family, &family_for(GetParam(), "test"));
  const std::vector<ParamSpec> specs = config.family->param_specs(config);
  ASSERT_FALSE(specs.empty());

  int embeddings = 0, heads = 0, final_norms = 0;
  std::set<std::string> names, hf_names;
  std::map<int64_t, int> routers_per_layer;
  std::set<int64_t> layers_seen;
  for (const ParamSpec& spec : specs) {
    SCOPED_TRACE(spec.name);
    EXPECT_TRUE(names.insert(spec.name).second) << "duplicate parameter";
    const int64_t named_layer = layer_in_name(spec.name);
    EXPECT_EQ(spec.layer, named_layer) << "the layer field disagrees with the name";
    if (spec.layer >= 0) {
      EXPECT_LT(spec.layer, config.num_hidden_layers);
      layers_seen.insert(spec.layer);
      EXPECT_NE(spec.role, ParamRole::Embedding);
      EXPECT_NE(spec.role, ParamRole::Head);
    } else {
      EXPECT_TRUE(spec.role == ParamRole::Embedding || spec.role == ParamRole::Head || spec.role == ParamRole::Norm)
          << "role '" << param_role_name(spec.role) << "' outside the decoder layers";
    }
    embeddings += spec.role == ParamRole::Embedding;
    heads += spec.role == ParamRole::Head;
    final_norms += spec.role == ParamRole::Norm && spec.layer == -1;
    if (spec.role == ParamRole::Norm) {
      EXPECT_EQ(spec.shape.size(), 1u);
    }
    if (spec.role == ParamRole::Embedding || spec.role == ParamRole::Head) {
      EXPECT_EQ(spec.shape, (Shape{config.vocab_size, config.hidden_size}));
    }
    if (spec.role == ParamRole::Router) {
      routers_per_layer[spec.layer] += spec.is_matrix();  // the projection; its bias, if any, is a vector
      EXPECT_TRUE(config.layer_is_moe(spec.layer)) << "a router on a dense layer";
    }
    if (spec.role == ParamRole::ExpertBank) {
      EXPECT_TRUE(config.layer_is_moe(spec.layer)) << "an expert bank on a dense layer";
      ASSERT_FALSE(spec.shape.empty());
      EXPECT_EQ(spec.shape[0], config.num_experts) << "an expert bank is sharded along dim 0 over the experts";
    }

    // Pieces that tile: the registry's own check, and the sizes summed here; every HF name once in the model.
    ASSERT_FALSE(spec.pieces.empty());
    EXPECT_NO_THROW(check_pieces_tile(spec.pieces, spec.shape, spec.name));
    int64_t covered = 0;
    for (const HfPiece& piece : spec.pieces) {
      covered += piece.numel();
      EXPECT_TRUE(hf_names.insert(piece.hf_name).second) << "HF name '" << piece.hf_name << "' used twice";
    }
    EXPECT_EQ(covered, shape_numel(spec.shape));
  }
  EXPECT_EQ(embeddings, 1);
  EXPECT_LE(heads, 1);
  EXPECT_EQ(heads, config.tie_word_embeddings ? 0 : 1);
  EXPECT_EQ(final_norms, 1);
  // Every decoder layer has parameters; each MoE layer exactly one router projection.
  EXPECT_EQ(static_cast<int64_t>(layers_seen.size()), config.num_hidden_layers);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    EXPECT_EQ(routers_per_layer[layer], config.layer_is_moe(layer) ? 1 : 0) << "layer " << layer;
  // A store accepts the layout (unique names, pieces that tile).
  EXPECT_NO_THROW(ParameterStore store(specs));
}

// Every golden dump (tests/data/golden/<dump>): one per family folder, and a family's other dumps (qwen3_5_moe, the
// MoE model of the qwen3_5 family, whose model_type names it too).
std::vector<std::string> golden_dumps() {
  std::vector<std::string> dumps;
  for (const auto& entry : std::filesystem::directory_iterator(testing::test_data_path("golden")))
    if (entry.is_directory()) dumps.push_back(entry.path().filename().string());
  std::sort(dumps.begin(), dumps.end());
  return dumps;
}

TEST(FamilyRegistry, EveryFamilyHasAGoldenDump) {
  const std::vector<std::string> dumps = golden_dumps();
  for (const std::string& name : registered_names())
    EXPECT_NE(std::find(dumps.begin(), dumps.end(), name), dumps.end()) << name;
}

INSTANTIATE_TEST_SUITE_P(Golden, RegisteredFamily, ::testing::ValuesIn(golden_dumps()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace moetrain::model
