// Tests of model.expert_weight_gradient = step (StageChunk::set_expert_weights_per_step): the expert banks' weight
// gradients computed once a step over every micro-batch's rows. A training step gives the same loss and the same bits
// of every other gradient as the per-micro-batch gradients, and expert-bank gradients that differ by f32 summation
// order only, on four families (routed experts; a dense first layer and shared experts; biases and the clamped
// SwiGLU; Gated DeltaNet layers with a gated shared expert); a layer whose stage 3 ran on its own rows holds their
// token-side sources instead of the rows, in less memory and to the same gradient bits; held work does not outlive a
// step (the next step's gradients are its own, a failed step leaves none); whole training runs on one rank and on two
// expert-parallel ranks follow the per-micro-batch runs; the job key is validated and the layouts it cannot run
// refused (a chunk with parameter hooks too).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/allocator.h"
#include "core/error.h"
#include "io/job_config.h"
#include "model/batch.h"
#include "model/causal_lm.h"
#include "model/model_config.h"
#include "pipeline/plain_executor.h"
#include "pipeline/stage_chunk.h"
#include "testing/cuda_compare.h"
#include "testing/executor_fixtures.h"
#include "testing/gpu.h"
#include "testing/test_data.h"
#include "testing/tiny_moe_job.h"
#include "train/launch.h"

namespace moetrain::pipeline {
namespace {

using fixtures::bitwise_equal;
using fixtures::make_batches;
using testing::expect_error;

// Per step and per micro-batch differ only in the f32 summation order of each expert's rows (a micro-batch's partial
// sum added to the running gradient, or one running sum over the step): a few units of f32 rounding (6e-8) relative.
// A misplaced row or a lost micro-batch moves an expert's gradient by O(1).
constexpr double kSummationOrder = 1e-6;

void expect_same_step(const model::CausalLm& per_micro_batch, const model::CausalLm& per_step, double loss_a,
                      double loss_b) {
  EXPECT_EQ(std::memcmp(&loss_a, &loss_b, sizeof(double)), 0) << loss_a << " vs " << loss_b;
  const std::vector<Tensor> want = per_micro_batch.params().all_grads(), got = per_step.params().all_grads();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const model::ParamSpec& spec = per_micro_batch.params().specs()[i];
    if (spec.role == model::ParamRole::ExpertBank) {
      EXPECT_LT(testing::relative_error(got[i], want[i]), kSummationOrder) << spec.name;
    } else {
      EXPECT_TRUE(bitwise_equal(got[i], want[i])) << spec.name;
    }
  }
}

// The four kinds of MoE layer: routed experts; a dense first layer and shared experts; biases and the clamped SwiGLU;
// Gated DeltaNet layers with a gated shared expert.
constexpr const char* kFamilies[] = {"../../examples/tiny_moe/config.json", "golden/deepseek_v2/config.json",
                                     "golden/gpt_oss/config.json", "golden/qwen3_5_moe/config.json"};

// The tiny example's job (one step of two 16-token rows) with these overrides.
io::JobConfig job(std::vector<std::string> overrides) {
  overrides.insert(overrides.begin(), {"train.steps=1", "train.seq_len=16", "train.global_batch=2"});
  return testing::tiny_moe_job(overrides);
}

TEST(ExpertWeightsPerStep, TrainsLikeThePerMicroBatchGradients) {
  for (const char* name : kFamilies) {
    SCOPED_TRACE(name);
    const model::ModelConfig config = model::load_model_config(testing::test_data_path(name));
    model::CausalLm per_micro_batch(config), per_step(config);
    for (model::CausalLm* m : {&per_micro_batch, &per_step}) m->params().init_random(23, 0.05);
    PlainExecutor a(per_micro_batch, nullptr), b(per_step, nullptr);
    b.set_expert_weights_per_step(true);
    // Two steps of three micro-batches: the second's gradients are its own (nothing held from the first).
    for (uint64_t seed : {41, 42}) {
      SCOPED_TRACE(seed);
      const std::vector<model::MicroBatch> batches = make_batches(3, seed, config.vocab_size);
      for (model::CausalLm* m : {&per_micro_batch, &per_step}) m->params().begin_accumulation();
      const double loss_a = a.run_step(batches).loss;
      const double loss_b = b.run_step(batches).loss;
      for (model::CausalLm* m : {&per_micro_batch, &per_step}) m->params().end_accumulation();
      expect_same_step(per_micro_batch, per_step, loss_a, loss_b);
    }
  }
}

// One step of `batches` run stage by stage, every MoE layer's stage-3 weight work held for the step's end
// (take_stage3_weight_work before stage1_backward_input, as StageChunk's full backward does) and run at once; the
// gradients (on the host), and the CPU bytes the step has alive while the work is held (a CPU model's).
struct HeldStep {
  std::vector<Tensor> grads;
  int64_t held_bytes = 0;
};

HeldStep step_with_held_expert_work(model::CausalLm& model, const std::vector<model::MicroBatch>& batches,
                                    bool own_rows) {
  const double scale = 1.0 / static_cast<double>(fixtures::count_targets(batches));
  const size_t n = model.layers().size();
  std::vector<std::vector<std::unique_ptr<model::LayerRecord>>> held(n);
  const int64_t before = memory_stats(DeviceKind::CPU).live_bytes;
  model.params().begin_accumulation();
  for (const model::MicroBatch& batch : model::to_device(batches, model.device())) {
    std::vector<std::unique_ptr<model::LayerRecord>> records(n);
    Tensor hidden = model.embed_forward(batch);
    for (size_t i = 0; i < n; ++i) {
      const model::DecoderLayer& layer = *model.layers()[i];
      records[i] = layer.new_record();
      const model::Dispatch dispatch = layer.stage1_forward(*records[i], hidden, batch);
      hidden =
          layer.stage5_forward(*records[i], layer.stage3_forward(*records[i], dispatch.rows, dispatch.group_offsets));
    }
    model::EpilogRecord epilog;
    model.head_forward(epilog, hidden, batch, scale);
    Tensor d = model.head_backward_input(epilog, scale);
    model.head_backward_weight(epilog);
    for (size_t i = n; i-- > 0;) {
      const model::DecoderLayer& layer = *model.layers()[i];
      const Tensor d_dispatched = layer.stage3_backward_input(*records[i], layer.stage5_backward_input(*records[i], d));
      if (layer.has_experts()) {
        held[i].push_back(layer.take_stage3_weight_work(*records[i], own_rows));
      } else {
        layer.stage3_backward_weight(*records[i]);
      }
      d = layer.stage1_backward_input(*records[i], d_dispatched);
      layer.stage1_backward_weight(*records[i]);
    }
    model.embed_backward(batch, d);
  }
  HeldStep out;
  out.held_bytes = memory_stats(DeviceKind::CPU).live_bytes - before;
  for (size_t i = 0; i < n; ++i) {
    std::vector<model::LayerRecord*> records;
    for (const auto& record : held[i]) records.push_back(record.get());
    if (!records.empty()) model.layers()[i]->stage3_backward_weight_together(records);
  }
  model.params().end_accumulation();
  for (const Tensor& g : model.params().all_grads()) out.grads.push_back(g.to(Device::cpu()));
  return out;
}

// The step with the rows' sources held against the step with the rows held, on two models made alike: the gradients
// of both, every one bitwise; returns the two steps (rows, sources).
std::pair<HeldStep, HeldStep> expect_sources_give_the_rows_bits(model::CausalLm& rows, model::CausalLm& sources,
                                                                const std::vector<model::MicroBatch>& batches) {
  HeldStep want = step_with_held_expert_work(rows, batches, false);
  HeldStep got = step_with_held_expert_work(sources, batches, true);
  EXPECT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < std::min(want.grads.size(), got.grads.size()); ++i) {
    EXPECT_TRUE(bitwise_equal(got.grads[i], want.grads[i])) << rows.params().specs()[i].name;
  }
  return {std::move(want), std::move(got)};
}

TEST(ExpertWeightsPerStep, OwnRowsAreHeldAsTheirSourcesToTheSameBits) {
  for (const char* name : kFamilies) {
    SCOPED_TRACE(name);
    const model::ModelConfig config = model::load_model_config(testing::test_data_path(name));
    model::CausalLm sources(config), rows(config);
    for (model::CausalLm* m : {&sources, &rows}) m->params().init_random(37, 0.05);
    // Micro-batches of 24 to 40 tokens: a row's K copies outweigh its token, and some experts get no rows.
    const std::vector<model::MicroBatch> batches = make_batches(3, 71, config.vocab_size, 24, 40);
    const auto [want, got] = expect_sources_give_the_rows_bits(rows, sources, batches);
    // Per MoE layer and micro-batch the sources hold [T, H] twice where the rows were [T*K, H] twice (K >= 2).
    EXPECT_LT(got.held_bytes, want.held_bytes) << "the sources were not held in place of the rows";
  }
}

// The same on CUDA in bf16 compute with an f32 residual stream (the workload's recipe): the output-row gradients are
// made from the stream's f32 gradient beside bf16 rows, and the gradients keep every bit of the held rows' step.
TEST(CudaExpertWeightsPerStep, OwnRowsAreHeldAsTheirSourcesToTheSameBits) {
  MT_REQUIRE_GPU();
  for (const char* name : kFamilies) {
    SCOPED_TRACE(name);
    const model::ModelConfig config = model::load_model_config(testing::test_data_path(name));
    model::CausalLm sources(config, Device::cuda(0), DType::BF16), rows(config, Device::cuda(0), DType::BF16);
    for (model::CausalLm* m : {&sources, &rows}) {
      m->set_stream_dtype(DType::F32);
      m->params().init_random(37, 0.05);
    }
    const std::vector<model::MicroBatch> batches = make_batches(3, 72, config.vocab_size, 64, 200);
    expect_sources_give_the_rows_bits(rows, sources, batches);
  }
}

// A step that stops after some backwards held their work (StageChunk::clear, what PlainExecutor runs when a step
// fails) leaves none for the next: its gradients are the per-micro-batch ones.
TEST(ExpertWeightsPerStep, ClearDropsHeldWork) {
  const model::ModelConfig config = fixtures::tiny_moe();
  model::CausalLm per_micro_batch(config), per_step(config);
  for (model::CausalLm* m : {&per_micro_batch, &per_step}) m->params().init_random(29, 0.05);
  StageLayers whole;
  whole.first_layer = 0;
  whole.end_layer = config.num_hidden_layers;
  whole.has_embedding = whole.has_final_norm = whole.has_head = true;
  StageChunk chunk(per_step, whole, nullptr);
  chunk.set_expert_weights_per_step(true);
  const std::vector<model::MicroBatch> stopped = make_batches(2, 51, config.vocab_size);
  for (int mb = 0; mb < 2; ++mb) {
    chunk.forward(mb, stopped[static_cast<size_t>(mb)], Tensor(), 0.01);
    chunk.backward_full(mb, Tensor(), 0.01);
  }
  expect_error([&] { chunk.set_expert_weights_per_step(false); },
               {"changes when it runs the expert weight gradients while it holds some"});
  chunk.clear();

  // The next step on the same chunk: its gradients are the per-micro-batch ones (none of the stopped step's rows).
  PlainExecutor a(per_micro_batch, nullptr);
  const std::vector<model::MicroBatch> batches = make_batches(3, 52, config.vocab_size);
  const int64_t targets = fixtures::count_targets(batches);
  const double scale = 1.0 / static_cast<double>(targets);
  for (model::CausalLm* m : {&per_micro_batch, &per_step}) m->params().begin_accumulation();
  const double loss_a = a.run_step(batches).loss;
  double ce_sum = 0.0;
  for (int mb = 0; mb < 3; ++mb) {
    ce_sum += chunk.forward(mb, batches[static_cast<size_t>(mb)], Tensor(), scale).loss.ce_sum();
    chunk.backward_full(mb, Tensor(), scale);
  }
  chunk.finish_expert_weights();
  const double loss_b = ce_sum / static_cast<double>(targets);
  for (model::CausalLm* m : {&per_micro_batch, &per_step}) m->params().end_accumulation();
  expect_same_step(per_micro_batch, per_step, loss_a, loss_b);
}

// Whole training runs, per step against per micro-batch: one rank, and two expert-parallel thread ranks (each holding
// its own experts' rows). Four steps of four micro-batches a rank: the gradients differ by f32 summation order only
// (< 1e-6 relative, above), which moves four steps' losses and gradient norms by far less than 1e-5 relative; a lost
// micro-batch or a misplaced row moves them at the first step by O(1e-2) or more.
TEST(ExpertWeightsPerStep, TrainingRunsMatchThePerMicroBatchRuns) {
  for (const std::vector<std::string>& layout : {std::vector<std::string>{"train.global_batch=4"},
                                                 std::vector<std::string>{"train.global_batch=8", "dist.local_ranks=2",
                                                                          "parallel.ep=2", "parallel.sharding=none"}}) {
    std::vector<std::string> overrides = layout;
    overrides.insert(overrides.end(), {"train.steps=4", "train.seq_len=32"});
    const train::TrainSummary want = train::run_training_job(job(overrides));
    overrides.push_back("model.expert_weight_gradient=step");
    const train::TrainSummary got = train::run_training_job(job(overrides));
    ASSERT_EQ(got.losses.size(), 4u);
    ASSERT_EQ(want.losses.size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_NEAR(got.losses[i], want.losses[i], 1e-5 * std::fabs(want.losses[i])) << layout.back() << " step " << i;
      EXPECT_NEAR(got.grad_norms[i], want.grad_norms[i], 1e-5 * std::fabs(want.grad_norms[i]))
          << layout.back() << " step " << i;
    }
  }
}

// Hooks that do nothing: a chunk with parameter hooks (ZeRO-3's, which free each layer's gradients after its backward)
// refuses to hold expert weight work.
struct NoHooks final : ParameterHooks {
  void before_forward(const ModelPart&) override {}
  void after_forward(const ModelPart&) override {}
  void before_backward(const ModelPart&) override {}
  void after_backward(const ModelPart&) override {}
};

TEST(ExpertWeightsPerStep, AChunkWithParameterHooksRefusesToHoldWeightWork) {
  const model::ModelConfig config = fixtures::tiny_moe();
  const auto model = fixtures::make_model(config, 31);
  StageLayers whole;
  whole.first_layer = 0;
  whole.end_layer = config.num_hidden_layers;
  whole.has_embedding = whole.has_final_norm = whole.has_head = true;
  StageChunk chunk(*model, whole, nullptr);
  NoHooks hooks;
  chunk.set_parameter_hooks(&hooks);
  chunk.set_expert_weights_per_step(true);
  const std::vector<model::MicroBatch> batches = make_batches(1, 61, config.vocab_size);
  chunk.forward(0, batches[0], Tensor(), 0.01);
  expect_error([&] { chunk.backward_full(0, Tensor(), 0.01); },
               {"holds the expert weight gradients for the step's end, but parameter hooks (ZeRO-3)"});
}

TEST(ExpertWeightsPerStep, TheJobKeyIsValidatedAndTheLayoutsItCannotRunRefused) {
  EXPECT_EQ(job({}).model.expert_weight_gradient, "micro_batch");
  EXPECT_EQ(job({"model.expert_weight_gradient=step"}).model.expert_weight_gradient, "step");
  expect_error([] { job({"model.expert_weight_gradient=layer"}); },
               {"model.expert_weight_gradient must be micro_batch or step but is 'layer'"});
  expect_error(
      [] {
        job({"model.expert_weight_gradient=step", "parallel.pp=2"});
      },
      {"model.expert_weight_gradient = step runs on the plain executor", "found pp = 2, schedule auto"});
  expect_error(
      [] {
        job({"model.expert_weight_gradient=step", "parallel.sharding=full"});
      },
      {"model.expert_weight_gradient = step holds every micro-batch's expert rows", "parallel.sharding = full"});
  expect_error(
      [] {
        job({"model.expert_weight_gradient=step", "exact.enabled=true"});
      },
      {"model.expert_weight_gradient = step is not an exact lane"});
  // Two data ranks under sharding auto are ZeRO-3: refused when the trainer picks it.
  expect_error(
      [] {
        train::run_training_job(job({"model.expert_weight_gradient=step", "dist.local_ranks=2"}));
      },
      {"parallel.sharding = auto shards over the 2 data ranks: set parallel.sharding = none"});
}

}  // namespace
}  // namespace moetrain::pipeline
