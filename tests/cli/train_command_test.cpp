// Tests for `moetrain train` and `moetrain convert`: override parsing, a run through the command
// line, exact mode on the tiny example as shipped, HF export of its checkpoint and import of an HF
// folder as a checkpoint to resume from.
#include "cli/train_command.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/convert_command.h"
#include "core/error.h"
#include "core/rng.h"
#include "io/json_fields.h"
#include "io/safetensors.h"
#include "model/causal_lm.h"
#include "testing/test_data.h"
#include "train/checkpoint.h"
#include "train/data/indexed_dataset.h"

namespace moetrain::cli {
namespace {

int run(std::vector<std::string> args) {
  args.insert(args.begin(), "moetrain");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_main(static_cast<int>(argv.size()), argv.data());
}

// A job on the golden qwen3 model (random init) over a small counting dataset.
std::string write_job(const std::string& dir) {
  train::data::IndexedDatasetBuilder builder(dir + "/docs", 8);
  for (int d = 0; d < 40; ++d) {
    std::vector<int32_t> doc;
    for (int i = 0; i < 10 + d % 7; ++i) doc.push_back(1 + (d + i) % 9);
    doc.push_back(0);
    builder.add_sequence(doc);
  }
  builder.finish();
  std::ofstream(dir + "/job.toml") << "[model]\nconfig = \"" << testing::test_data_path("golden/qwen3")
                                   << "\"\n[data]\npath = \"docs\"\n[train]\nsteps = 4\nseq_len = 16\n"
                                      "micro_batch = 2\nglobal_batch = 4\n[checkpoint]\ndir = \"ckpt\"\nevery = 2\n"
                                      "[metrics]\nconsole_every = 10\n";
  return dir + "/job.toml";
}

TEST(TrainCommand, CollectsOverridesInBothSpellings) {
  EXPECT_EQ(collect_overrides({"--optim.lr=1e-4", "--train.steps", "5"}),
            (std::vector<std::string>{"optim.lr=1e-4", "train.steps=5"}));
  EXPECT_THROW(collect_overrides({"steps=5"}), Error);
  EXPECT_THROW(collect_overrides({"--train.steps"}), Error);
}

TEST(TrainCommand, RunsAJobAndExportsItsCheckpointAsHuggingFace) {
  const std::string dir = testing::make_temp_dir("train_cmd");
  const std::string job = write_job(dir);
  ASSERT_EQ(run({"train", "--config", job, "--train.steps=4"}), 0);
  EXPECT_EQ(train::list_checkpoints(dir + "/ckpt"), (std::vector<int64_t>{2, 4}));

  ASSERT_EQ(run({"convert", "--checkpoint", dir + "/ckpt", "--out", dir + "/hf"}), 0);
  const auto exported = model::CausalLm::from_hf(dir + "/hf");
  const train::CheckpointData ckpt = train::load_checkpoint(dir + "/ckpt/step_00000004");
  std::map<std::string, Tensor> saved(ckpt.model.begin(), ckpt.model.end());
  for (const auto& [name, tensor] : exported->params().export_hf()) {
    EXPECT_EQ(tensor.to_vector<float>(), saved.at(name).to_vector<float>()) << name;
  }
}

// --dtype bf16 writes every tensor as its master rounded to bf16 and says so in config.json; the folder loads back as
// those rounded values. An import takes no --dtype, and another dtype is refused by name.
TEST(TrainCommand, ExportsInBf16WhenAsked) {
  const std::string dir = testing::make_temp_dir("train_cmd_bf16");
  const std::string job = write_job(dir);
  ASSERT_EQ(run({"train", "--config", job, "--train.steps=2"}), 0);
  ASSERT_EQ(run({"convert", "--checkpoint", dir + "/ckpt", "--out", dir + "/hf", "--dtype", "bf16"}), 0);
  const io::SafetensorsReader reader = io::SafetensorsReader::open(dir + "/hf");
  const train::CheckpointData ckpt = train::load_checkpoint(dir + "/ckpt/step_00000002");
  for (const auto& [name, master] : ckpt.model) {
    ASSERT_EQ(reader.entry(name).dtype, DType::BF16) << name;
    EXPECT_EQ(reader.tensor(name).to(DType::F32).to_vector<float>(),
              master.to(DType::BF16).to(DType::F32).to_vector<float>())
        << name;
  }
  EXPECT_EQ(io::read_json_object(dir + "/hf/config.json").at("dtype"), "bfloat16");
  EXPECT_NO_THROW(model::CausalLm::from_hf(dir + "/hf"));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run({"convert", "--checkpoint", dir + "/ckpt", "--out", dir + "/hf16", "--dtype", "f16"}), 1);
  EXPECT_EQ(run({"convert", "--hf", dir + "/hf", "--out", dir + "/back", "--dtype", "bf16"}), 1);
  const std::string errors = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(errors.find("--dtype must be f32 or bf16 but is 'f16'"), std::string::npos) << errors;
  EXPECT_NE(errors.find("--dtype applies to an export"), std::string::npos) << errors;
  EXPECT_FALSE(std::filesystem::exists(dir + "/hf16")) << "a refused export wrote nothing";
}

// Two thread ranks with ZeRO-3 write a sharded checkpoint (one file per rank); convert exports one HF folder whose
// weights are those of a replicated two-rank run within fp32 summation order (the two runs reduce gradients in
// another order).
TEST(TrainCommand, ExportsAShardedCheckpointAsOneHuggingFaceFolder) {
  const std::string dir = testing::make_temp_dir("train_cmd_sharded");
  const std::string job = write_job(dir);
  ASSERT_EQ(run({"train", "--config", job, "--dist.local_ranks=2", "--parallel.sharding=full"}), 0);
  EXPECT_TRUE(train::is_sharded_checkpoint(dir + "/ckpt/step_00000004"));
  ASSERT_EQ(run({"convert", "--checkpoint", dir + "/ckpt", "--out", dir + "/hf"}), 0);
  ASSERT_EQ(run({"train", "--config", job, "--dist.local_ranks=2", "--parallel.sharding=none",
                 "--checkpoint.dir=" + dir + "/replicated"}),
            0);
  EXPECT_FALSE(train::is_sharded_checkpoint(dir + "/replicated/step_00000004"));
  const auto exported = model::CausalLm::from_hf(dir + "/hf");
  const train::CheckpointData replicated = train::load_checkpoint(dir + "/replicated/step_00000004");
  std::map<std::string, Tensor> want(replicated.model.begin(), replicated.model.end());
  for (const auto& [name, tensor] : exported->params().export_hf()) {
    EXPECT_LT(testing::relative_error(tensor, want.at(name)), 1e-5) << name;
  }
}

TEST(TrainCommand, ImportedHuggingFaceFolderIsResumedFrom) {
  const std::string dir = testing::make_temp_dir("import_cmd");
  const std::string job = write_job(dir);
  ASSERT_EQ(run({"convert", "--hf", testing::test_data_path("golden/qwen3"), "--out", dir + "/ckpt"}), 0);
  EXPECT_EQ(train::list_checkpoints(dir + "/ckpt"), (std::vector<int64_t>{0}));
  // Resuming from the imported step 0 starts from the golden weights, not from the random init.
  ASSERT_EQ(run({"train", "--config", job, "--train.steps=1", "--optim.lr=0", "--checkpoint.every=1"}), 0);
  const auto golden = model::CausalLm::from_hf(testing::test_data_path("golden/qwen3"));
  const train::CheckpointData after = train::load_checkpoint(dir + "/ckpt/step_00000001");
  std::map<std::string, Tensor> saved(after.model.begin(), after.model.end());
  for (const auto& [name, tensor] : golden->params().export_hf()) {
    // lr = 0: AdamW's decoupled decay multiplies by (1 - 0 * wd) = 1, so the weights are unchanged.
    EXPECT_EQ(tensor.to_vector<float>(), saved.at(name).to_vector<float>()) << name;
  }
}

// examples/tiny_moe/job.toml as shipped (packed micro-batches of 4 rows of 128 tokens), its data prepared as
// scripts/run.sh prepares it (plain text, one document per paragraph, byte-level tokens), from paragraphs of 20 to
// 1500 bytes: many documents run over rows and micro-batches. Exact mode admits it, checks every micro-batch's varlen
// metadata with the declared max length seq_len, and trains.
TEST(TrainCommand, TrainsTheTinyExampleAsShippedInExactMode) {
  const std::string dir = testing::make_temp_dir("train_exact_tiny");
  Rng rng(2024);
  std::vector<std::string> texts;
  for (int f = 0; f < 3; ++f) {
    texts.push_back(dir + "/text" + std::to_string(f) + ".txt");
    std::ofstream out(texts.back());
    for (int paragraph = 0; paragraph < 12; ++paragraph) {
      const uint64_t length = 20 + rng.below(1480);
      std::string line;
      for (uint64_t i = 0; i < length; ++i) {
        line += rng.below(6) == 0 ? ' ' : static_cast<char>('a' + rng.below(26));
        if (line.size() == 70) {
          out << line << "\n";
          line.clear();
        }
      }
      out << line << "\n\n";
    }
  }
  std::vector<std::string> prepare = {"data", "prepare", "--text"};
  prepare.insert(prepare.end(), texts.begin(), texts.end());
  prepare.insert(prepare.end(), {"--output", dir + "/data/licenses"});
  ASSERT_EQ(run(prepare), 0);

  const std::string job = testing::repo_path("examples/tiny_moe/job.toml");
  // The shipped [eval] held out on the same text here, so the exact run evaluates too (its held-out set of
  // /usr/share/doc files is made by scripts/run.sh, not by the tests).
  ASSERT_EQ(run({"train", "--config", job, "--exact.enabled=true", "--data.path=" + dir + "/data/licenses",
                 "--eval.path=" + dir + "/data/licenses", "--train.steps=3", "--checkpoint.dir=",
                 "--metrics.jsonl=" + dir + "/metrics.jsonl", "--metrics.tensorboard=" + dir + "/tensorboard"}),
            0)
      << "exact mode refused the tiny example (see the error above)";
  std::ifstream metrics(dir + "/metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json record = nlohmann::json::parse(line);
    ++steps;
    EXPECT_EQ(record["step"], steps);
    EXPECT_EQ(record["tokens"], 1024) << "2 micro-batches of 4 rows of 128 tokens";
    EXPECT_TRUE(std::isfinite(record["loss"].get<double>())) << line;
  }
  EXPECT_EQ(steps, 3);
}

TEST(TrainCommand, BadConfigExitsNonZeroWithoutTraining) {
  const std::string dir = testing::make_temp_dir("train_bad");
  const std::string job = write_job(dir);
  EXPECT_EQ(run({"train", "--config", job, "--optim.lrr=1"}), 1);
  EXPECT_EQ(run({"train", "--config", job, "--train.steps=many"}), 1);
  EXPECT_EQ(run({"train", "--config", job, "--data.path=" + dir + "/missing"}), 1);
  EXPECT_FALSE(std::filesystem::exists(dir + "/ckpt"));
}

TEST(ConvertCommand, RejectsAFolderWithoutCheckpoints) {
  const std::string dir = testing::make_temp_dir("convert_bad");
  EXPECT_EQ(run({"convert", "--checkpoint", dir, "--out", dir + "/hf"}), 1);
  EXPECT_FALSE(std::filesystem::exists(dir + "/hf"));
}

}  // namespace
}  // namespace moetrain::cli
