// Tests for exact/admission: a refusal test for every rule of the exact-lane contract (the error names the rule, what
// was declared and what was found), the two-pass property (one bad stage marks and logs nothing), and accepted
// configurations (a tiny 8-layer MoE with P = 1, 2, 4). Partitions are written by hand, not by partition.cpp.
#include "exact/admission.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"

namespace moetrain::exact {
namespace {

using pipeline::Partition;
using pipeline::StageLayers;

model::ModelConfig tiny_moe(int64_t layers = 8) {
  const nlohmann::json config = {{"model_type", "qwen3_moe"},
                                 {"vocab_size", 64},
                                 {"hidden_size", 16},
                                 {"num_hidden_layers", layers},
                                 {"num_attention_heads", 2},
                                 {"num_key_value_heads", 1},
                                 {"head_dim", 8},
                                 {"intermediate_size", 32},
                                 {"rms_norm_eps", 1e-6},
                                 {"num_experts", 4},
                                 {"num_experts_per_tok", 2},
                                 {"moe_intermediate_size", 8}};
  return model::parse_model_config(config.dump(), "test/config.json");
}

// P ranks, 2P stages cut at `ends` (the end layer of each stage), laid out in a V.
Partition partition_with_ends(int pp, const std::vector<int64_t>& ends) {
  Partition p;
  p.pp = pp;
  int64_t begin = 0;
  for (int s = 0; s < static_cast<int>(ends.size()); ++s) {
    StageLayers st;
    st.stage = s;
    st.rank = s < pp ? s : 2 * pp - 1 - s;
    st.first_layer = begin;
    st.end_layer = ends[static_cast<size_t>(s)];
    st.has_embedding = s == 0;
    st.has_final_norm = s + 1 == static_cast<int>(ends.size());
    st.has_head = st.has_final_norm;
    p.stages.push_back(st);
    begin = st.end_layer;
  }
  return p;
}

// 8 layers in 2P equal stages.
Partition even_partition(int pp, int64_t layers = 8) {
  std::vector<int64_t> ends;
  for (int s = 1; s <= 2 * pp; ++s) ends.push_back(layers * s / (2 * pp));
  return partition_with_ends(pp, ends);
}

std::vector<ParamDType> bf16_params(int64_t layers = 8) {
  std::vector<ParamDType> params = {{"embed_tokens", DType::BF16, ""}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::string prefix = "layers." + std::to_string(l) + ".";
    for (const char* name :
         {"input_norm", "attn.qkv", "attn.o_proj", "post_norm", "router", "experts.gate_up", "experts.down"}) {
      params.push_back({prefix + name, DType::BF16, ""});
    }
  }
  params.push_back({"norm", DType::BF16, ""});
  params.push_back({"lm_head", DType::BF16, ""});
  return params;
}

ExactDeclaration good_declaration() {
  ExactDeclaration d;
  d.model_type = "qwen3_moe";
  d.parameter_dtypes = bf16_params();
  return d;
}

// The refusal's message; fails the test when admit_exact accepts.
std::string refusal(const ExactDeclaration& d, const model::ModelConfig& c, const Partition& p) {
  try {
    admit_exact(d, c, p);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "admit_exact accepted a configuration it should refuse";
  return "";
}

// Passes when `needle` occurs in `text`; prints the whole text otherwise.
::testing::AssertionResult contains(const std::string& text, const std::string& needle) {
  if (text.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected to find\n  " << needle << "\nin\n  " << text;
}
#define EXPECT_CONTAINS(text, needle) EXPECT_TRUE(contains(text, needle))

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++n;
  return n;
}

// ---- accepted configurations ----

TEST(ExactAdmission, AcceptsTinyMoeWithOneTwoAndFourRanks) {
  for (int pp : {1, 2, 4}) {
    SCOPED_TRACE(pp);
    const Partition p = even_partition(pp);
    EXPECT_TRUE(exact_violations(good_declaration(), tiny_moe(), p).empty());
    const AdmissionReport report = admit_exact(good_declaration(), tiny_moe(), p);
    ASSERT_EQ(report.stages.size(), static_cast<size_t>(2 * pp));
    for (size_t s = 0; s < report.stages.size(); ++s) {
      EXPECT_EQ(report.stages[s].stage, p.stages[s].stage);
      EXPECT_EQ(report.stages[s].rank, p.stages[s].rank);
      EXPECT_EQ(report.stages[s].first_layer, p.stages[s].first_layer);
      EXPECT_EQ(report.stages[s].end_layer, p.stages[s].end_layer);
    }
  }
}

TEST(ExactAdmission, LogLineNamesStageRankLayersWireAndKernels) {
  const AdmissionReport two = admit_exact(good_declaration(), tiny_moe(), even_partition(2));
  ASSERT_EQ(two.stages.size(), 4u);
  EXPECT_EQ(two.stages[0].log_line,
            "exact: stage 0 (rank 0, layers 0-1) engaged: bf16 wire, batch-invariant kernels on cpu");
  EXPECT_EQ(two.stages[2].log_line,
            "exact: stage 2 (rank 1, layers 4-5) engaged: bf16 wire, batch-invariant kernels on cpu");
  EXPECT_EQ(two.stages[3].log_line,
            "exact: stage 3 (rank 0, layers 6-7) engaged: bf16 wire, batch-invariant kernels on cpu");
  const AdmissionReport four = admit_exact(good_declaration(), tiny_moe(), even_partition(4));
  ASSERT_EQ(four.stages.size(), 8u);
  EXPECT_EQ(four.stages[5].log_line,
            "exact: stage 5 (rank 2, layer 5) engaged: bf16 wire, batch-invariant kernels on cpu");
}

TEST(ExactAdmission, LogsOneLinePerStageWhenItEngages) {
  setup_logging(LogLevel::Info);
  ::testing::internal::CaptureStderr();
  const AdmissionReport report = admit_exact(good_declaration(), tiny_moe(), even_partition(2));
  const std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(logged, "engaged"), 4);
  for (const StageAdmission& s : report.stages) EXPECT_CONTAINS(logged, s.log_line);
}

TEST(ExactAdmission, AcceptsUnevenCutsOnLayerBoundaries) {
  EXPECT_EQ(admit_exact(good_declaration(), tiny_moe(), partition_with_ends(2, {1, 4, 5, 8})).stages.size(), 4u);
}

TEST(ExactAdmission, AcceptsDenseQwen3) {
  const nlohmann::json config = {{"model_type", "qwen3"},  {"vocab_size", 64},         {"hidden_size", 16},
                                 {"num_hidden_layers", 8}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                                 {"head_dim", 8},          {"intermediate_size", 32},  {"rms_norm_eps", 1e-6}};
  const model::ModelConfig c = model::parse_model_config(config.dump(), "test/config.json");
  ExactDeclaration d = good_declaration();
  d.model_type = "qwen3";
  EXPECT_EQ(admit_exact(d, c, even_partition(1)).stages.size(), 2u);
}

TEST(ExactAdmission, AcceptsUniformFp32MastersUnderBf16Compute) {
  ExactDeclaration d = good_declaration();
  for (ParamDType& p : d.parameter_dtypes) p.dtype = DType::F32;
  EXPECT_TRUE(exact_violations(d, tiny_moe(), even_partition(2)).empty());
}

TEST(ExactAdmission, AcceptsAllowListedFp32PinsAmongBf16Parameters) {
  ExactDeclaration d = good_declaration();
  d.parameter_dtypes.push_back({"layers.0.linear_attn.A_log", DType::F32, "A_log"});
  d.parameter_dtypes.push_back({"layers.0.linear_attn.dt_bias", DType::F32, "dt_bias"});
  EXPECT_TRUE(exact_violations(d, tiny_moe(), even_partition(2)).empty());
}

TEST(ExactAdmission, AcceptsPipelineSafeAuxLosses) {
  for (const char* variant : {"micro_batch", "sequence"}) {
    ExactDeclaration d = good_declaration();
    d.load_balance = variant;
    d.load_balance_coef = 0.01;
    d.z_loss_coef = 0.001;
    EXPECT_TRUE(exact_violations(d, tiny_moe(), even_partition(2)).empty()) << variant;
  }
  ExactDeclaration off = good_declaration();
  off.load_balance = "global_batch";  // with a zero coefficient nothing is computed
  EXPECT_TRUE(exact_violations(off, tiny_moe(), even_partition(2)).empty());
}

// DeepSeek-V2's device-level balance reads one micro-batch alone: admitted for every D dividing the 4 experts, and
// with the expert-level load balance beside it.
TEST(ExactAdmission, AcceptsTheDeviceBalanceLoss) {
  for (int64_t groups : {1, 2, 4}) {
    ExactDeclaration d = good_declaration();
    d.load_balance_coef = 0.01;
    d.device_balance_coef = 0.05;
    d.device_balance_groups = groups;
    EXPECT_TRUE(exact_violations(d, tiny_moe(), even_partition(2)).empty()) << groups;
  }
  ExactDeclaration off = good_declaration();
  off.device_balance_groups = 3;  // with a zero coefficient the groups are not used
  EXPECT_TRUE(exact_violations(off, tiny_moe(), even_partition(2)).empty());
}

// ---- the two-pass property ----

TEST(ExactAdmission, OneBadStageMarksAndLogsNothing) {
  Partition p = even_partition(2);
  p.stages[2].has_final_norm = true;  // stage 2 of 4 is bad; stages 0, 1 and 3 are fine
  setup_logging(LogLevel::Info);
  ::testing::internal::CaptureStderr();
  AdmissionReport report;
  EXPECT_THROW(report = admit_exact(good_declaration(), tiny_moe(), p), Error);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(report.empty());
  EXPECT_EQ(count_of(logged, "engaged"), 0) << logged;
}

TEST(ExactAdmission, ListsEveryViolationInOneError) {
  ExactDeclaration d = good_declaration();
  d.wire_dtype = DType::F32;
  d.load_balance = "global_batch";
  d.load_balance_coef = 0.01;
  Partition p = even_partition(2);
  p.stages[1].has_head = true;
  const std::vector<Violation> violations = exact_violations(d, tiny_moe(), p);
  ASSERT_EQ(violations.size(), 3u);
  const std::string message = refusal(d, tiny_moe(), p);
  EXPECT_EQ(count_of(message, "exact: refused: "), 3) << message;
  for (const Violation& v : violations) EXPECT_CONTAINS(message, v.message());
  EXPECT_CONTAINS(message, "exact: refused: wire dtype:");
  EXPECT_CONTAINS(message, "exact: refused: load-balance loss:");
  EXPECT_CONTAINS(message, "exact: refused: final norm and head on the last stage:");
}

// ---- one refusal per rule ----

TEST(ExactAdmission, RefusesFewerLayersThanStages) {
  // 3 layers cannot fill 2P = 4 stages: the last stage would hold none.
  const Partition p = partition_with_ends(2, {1, 2, 3, 3});
  std::vector<Violation> out;
  check_layer_count(tiny_moe(3), p, out);
  ASSERT_EQ(out.size(), 1u);
  const std::string message = refusal(good_declaration(), tiny_moe(3), p);
  EXPECT_CONTAINS(message,
                  "exact: refused: fewer layers than stages: declared P = 2, so 2P = 4 stages of >= 1 decoder "
                  "layer each, found 3 decoder layers in the model");
}

TEST(ExactAdmission, RefusesAStageWithoutLayers) {
  const std::string message = refusal(good_declaration(), tiny_moe(), partition_with_ends(2, {2, 4, 4, 8}));
  EXPECT_CONTAINS(message,
                  "exact: refused: cuts on layer boundaries: declared stage 2 holds >= 1 decoder layer, "
                  "found stage 2 (rank 1, layers [4, 4)) holding 0 layers");
}

TEST(ExactAdmission, RefusesStagesThatDoNotCoverEveryLayer) {
  const std::string message = refusal(good_declaration(), tiny_moe(), partition_with_ends(2, {2, 4, 6, 7}));
  EXPECT_CONTAINS(message,
                  "exact: refused: cuts on layer boundaries: declared the last stage ends at layer 8 "
                  "(the model's count), found stage 3 (rank 0, layers [6, 7))");
  EXPECT_CONTAINS(message, "declared each of the 8 decoder layers held exactly once, found the stages hold 7");
}

TEST(ExactAdmission, RefusesStagesOutOfOrderOrOutsideTheModel) {
  Partition p = even_partition(1);
  std::swap(p.stages[0].first_layer, p.stages[1].first_layer);
  std::swap(p.stages[0].end_layer, p.stages[1].end_layer);
  std::string message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message,
                  "exact: refused: cuts on layer boundaries: declared stages in ascending layer order, "
                  "found stage 1 (rank 0, layers [0, 4)) after stage 0 (rank 0, layers [4, 8))");
  message = refusal(good_declaration(), tiny_moe(), partition_with_ends(1, {4, 9}));
  EXPECT_CONTAINS(message,
                  "exact: refused: cuts on layer boundaries: declared stage 1 inside decoder layers "
                  "[0, 8), found stage 1 (rank 0, layers [4, 9))");
}

TEST(ExactAdmission, RefusesStagesThatLoseGlobalLayerIdentity) {
  // Stage 1 numbers its layers from 0 again (local indices) instead of continuing at 4.
  Partition p = even_partition(1);
  p.stages[1].first_layer = 0;
  p.stages[1].end_layer = 4;
  std::vector<Violation> out;
  check_global_layer_identity(p, out);
  ASSERT_EQ(out.size(), 1u);
  const std::string message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message,
                  "exact: refused: global layer identity: declared stage 1 starts at global layer 4 "
                  "(where stage 0 ends), found stage 1 (rank 0, layers [0, 4))");
}

TEST(ExactAdmission, RefusesAWrongStageLayout) {
  Partition p = even_partition(2);
  p.stages.pop_back();
  std::string message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message, "exact: refused: stage layout: declared 2P = 4 stages for P = 2, found 3 stages");
  p = even_partition(2);
  p.stages[3].rank = 1;  // stage 3 of a V over 2 ranks runs on rank 0
  message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message,
                  "exact: refused: stage layout: declared entry 3 to be stage 3 on rank 0, found stage 3 on "
                  "rank 1");
  p = even_partition(2);
  p.pp = 0;
  message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message, "exact: refused: stage layout: declared pipeline ranks P >= 1, found P = 0");
}

TEST(ExactAdmission, RefusesEmbeddingOffTheFirstStage) {
  Partition p = even_partition(2);
  p.stages[0].has_embedding = false;
  p.stages[1].has_embedding = true;
  const std::string message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message,
                  "exact: refused: embedding on the first stage: declared the token embedding on stage "
                  "0, found stage 0 (rank 0, layers [0, 2)) without it");
  EXPECT_CONTAINS(message,
                  "exact: refused: embedding on the first stage: declared the token embedding on stage "
                  "0 only, found it also on stage 1 (rank 1, layers [2, 4))");
}

TEST(ExactAdmission, RefusesACutThatSplitsTheFinalNormFromTheHead) {
  Partition p = even_partition(2);
  p.stages[2].has_final_norm = true;  // the norm ends stage 2, the head starts stage 3
  p.stages[3].has_final_norm = false;
  std::vector<Violation> out;
  check_head_placement(p, out);
  ASSERT_EQ(out.size(), 1u);
  const std::string message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message,
                  "exact: refused: final norm and head on the last stage: declared the final norm and "
                  "the head together on stage 3 (the last) only, found the final norm on stage 2 and "
                  "the head on stage 3");
}

TEST(ExactAdmission, RefusesAHeadMissingFromTheLastStage) {
  Partition p = even_partition(1);
  p.stages[1].has_head = false;
  p.stages[1].has_final_norm = false;
  const std::string message = refusal(good_declaration(), tiny_moe(), p);
  EXPECT_CONTAINS(message, "found the final norm on no stage and the head on no stage");
}

// A family whose layers have no exact program (as a new family starts out): only its certification matters here.
class UncertifiedFamily final : public model::Family {
 public:
  std::string name() const override { return "uncertified"; }
  std::vector<std::string> model_types() const override { return {"uncertified_family"}; }
  model::ModelConfig parse_config(const io::JsonFields&) const override { return {}; }
  std::string to_hf_config_json(const model::ModelConfig&) const override { return "{}"; }
  std::vector<model::ParamSpec> param_specs(const model::ModelConfig&) const override { return {}; }
  std::unique_ptr<model::DecoderLayer> make_layer(const model::ModelConfig&, model::ParameterStore&,
                                                  int64_t) const override {
    return nullptr;
  }
  ops::RmsNormParams final_norm(const model::ModelConfig&) const override { return {}; }
  model::LayerFlops layer_flops(const model::ModelConfig&, int64_t, int64_t) const override { return {}; }
  model::LayerActivationShape layer_activation_shape(const model::ModelConfig&, int64_t) const override {
    return {.not_modeled = "a test family"};
  }
  model::ExactCertification exact_certification(const model::ModelConfig&) const override {
    return {false, "its layers have no batch-invariant exact program yet"};
  }
};

TEST(ExactAdmission, RefusesAnUncertifiedModelFamily) {
  static const UncertifiedFamily uncertified;
  model::ModelConfig c = tiny_moe();
  c.family = &uncertified;
  c.model_type = "uncertified_family";
  ExactDeclaration d = good_declaration();
  d.model_type = "uncertified_family";
  const std::string message = refusal(d, c, even_partition(2));
  std::string certified;
  for (const std::string& t : certified_model_types()) certified += (certified.empty() ? "" : ", ") + t;
  EXPECT_CONTAINS(message, "exact: refused: model family: declared a family certified for exact mode (" + certified +
                               "), found 'uncertified_family': its layers have no batch-invariant exact program");
}

TEST(ExactAdmission, RefusesADeclaredFamilyOtherThanTheConfigs) {
  ExactDeclaration d = good_declaration();
  d.model_type = "qwen3";
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: model family: declared 'qwen3', found 'qwen3_moe' in the model's config.json");
}

TEST(ExactAdmission, RefusesANonBf16ComputeDtype) {
  ExactDeclaration d = good_declaration();
  d.compute_dtype = "f16";
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: compute dtype: declared 'f16', found exact lanes certified for bf16 compute");
}

TEST(ExactAdmission, RefusesANonBf16WireDtype) {
  ExactDeclaration d = good_declaration();
  d.wire_dtype = DType::F32;
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: wire dtype: declared f32, found exact lanes cut only where the "
                  "residual stream is materialised in bf16");
}

TEST(ExactAdmission, RefusesMixedParameterDtypesOutsideTheAllowList) {
  ExactDeclaration d = good_declaration();
  d.parameter_dtypes[3].dtype = DType::F32;  // layers.0.attn.o_proj: not a pin
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: parameter dtypes: declared bf16 compute: every parameter bf16 except "
                  "the fp32 pins (A_log, dt_bias), or every parameter f32, found 1 of 59 parameters "
                  "otherwise: layers.0.attn.o_proj f32");
}

TEST(ExactAdmission, RefusesHalfPrecisionParameters) {
  ExactDeclaration d = good_declaration();
  for (ParamDType& p : d.parameter_dtypes) p.dtype = DType::F16;
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message, "found 59 of 59 parameters otherwise: embed_tokens f16, layers.0.input_norm f16");
  EXPECT_CONTAINS(message, "and 51 more");
}

TEST(ExactAdmission, RefusesAnFp32PinInBf16OnlyWhenNotAllowListed) {
  ExactDeclaration d = good_declaration();
  d.fp32_pins = {"dt_bias"};  // the job narrows the list: A_log must then be bf16
  d.parameter_dtypes.push_back({"layers.0.linear_attn.A_log", DType::F32, "A_log"});
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message, "except the fp32 pins (dt_bias)");
  EXPECT_CONTAINS(message, "found 1 of 60 parameters otherwise: layers.0.linear_attn.A_log f32");
}

TEST(ExactAdmission, RefusesAnUncertifiedFp32Pin) {
  ExactDeclaration d = good_declaration();
  d.fp32_pins = {"A_log", "router"};
  d.parameter_dtypes[5].dtype = DType::F32;  // layers.0.router
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: fp32 pins: declared fp32 pins 'router', found only A_log, dt_bias certified");
  EXPECT_CONTAINS(message, "found 1 of 59 parameters otherwise: layers.0.router f32");
}

TEST(ExactAdmission, RefusesMissingParameterDtypes) {
  ExactDeclaration d = good_declaration();
  d.parameter_dtypes.clear();
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: parameter dtypes: declared bf16 compute with bf16 parameters (or "
                  "uniformly f32 masters), found no parameter dtypes");
}

TEST(ExactAdmission, AdmitsCudaNamingItsBatchInvariantKernelsOnEveryStage) {
  ExactDeclaration d = good_declaration();
  d.device = Device::cuda(0);
  ::testing::internal::CaptureStderr();
  const AdmissionReport report = admit_exact(d, tiny_moe(), even_partition(2));
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(report.stages.size(), 4u);
  EXPECT_EQ(count_of(logged,
                     "batch-invariant kernels on cuda:0 (gemm, grouped_gemm, attention, gated_delta, norm and "
                     "cross_entropy)"),
            4)
      << logged;
  ASSERT_EQ(cuda_batch_invariant_kernels().size(), 5u);
  for (const CertifiedKernel& k : cuda_batch_invariant_kernels()) EXPECT_FALSE(k.variant.empty()) << k.kernel;
  for (const StageAdmission& stage : report.stages) EXPECT_CONTAINS(stage.log_line, "on cuda:0 (gemm,");
}

TEST(ExactAdmission, NamesNoKernelsOnTheCpu) {
  ::testing::internal::CaptureStderr();
  const AdmissionReport report = admit_exact(good_declaration(), tiny_moe(), even_partition(2));
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(report.stages.size(), 4u);
  for (const StageAdmission& stage : report.stages) {
    EXPECT_TRUE(stage.log_line.ends_with("batch-invariant kernels on cpu")) << stage.log_line;
  }
  EXPECT_EQ(count_of(logged, "engaged"), 4) << logged;
}

TEST(ExactAdmission, RefusesALossWithoutAPipelinePath) {
  ExactDeclaration d = good_declaration();
  d.loss = "sequence_mean";
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: loss: declared 'sequence_mean', found a pipeline-parallel path only "
                  "for 'cross_entropy' (token-weighted)");
}

TEST(ExactAdmission, RefusesTheGlobalBatchLoadBalanceLoss) {
  ExactDeclaration d = good_declaration();
  d.load_balance = "global_batch";
  d.load_balance_coef = 0.01;
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: load-balance loss: declared variant 'global_batch' with coefficient "
                  "0.01, found no pipeline path: its expert counts accumulate over the step's earlier "
                  "micro-batches");
}

TEST(ExactAdmission, RefusesDeviceGroupsThatDoNotDivideTheExperts) {
  for (int64_t groups : {0, 3, 8}) {
    ExactDeclaration d = good_declaration();
    d.device_balance_coef = 0.05;
    d.device_balance_groups = groups;
    const std::string message = refusal(d, tiny_moe(), even_partition(2));
    EXPECT_CONTAINS(message, "exact: refused: device-balance loss: declared " + std::to_string(groups) +
                                 " device groups with coefficient 0.05, found 4 experts, which groups of equal size "
                                 "cannot cover; use a divisor of 4 (loss.device_balance_groups)");
  }
}

TEST(ExactAdmission, RefusesANegativeOrNonFiniteDeviceBalanceCoefficient) {
  for (double coef : {-0.05, std::numeric_limits<double>::infinity(), std::nan("")}) {
    ExactDeclaration d = good_declaration();
    d.device_balance_coef = coef;
    const std::string message = refusal(d, tiny_moe(), even_partition(2));
    EXPECT_CONTAINS(message, "exact: refused: device-balance loss: declared coefficient ");
    EXPECT_CONTAINS(message, "found a finite coefficient >= 0 (0 turns the loss off)");
  }
}

TEST(ExactAdmission, RefusesAnUnknownLoadBalanceVariant) {
  ExactDeclaration d = good_declaration();
  d.load_balance = "per_token";
  const std::string message = refusal(d, tiny_moe(), even_partition(2));
  EXPECT_CONTAINS(message,
                  "exact: refused: load-balance loss: declared variant 'per_token', found known variants "
                  "micro_batch, sequence, global_batch");
}

}  // namespace
}  // namespace moetrain::exact
