// Tests for train/trainer: exact resume (moments in f32 or bf16, and converted between them), the golden AdamW
// trajectory through the trainer itself,
// the load-balance and device-balance losses in training, and NaN detection that never writes a poisoned checkpoint.
#include "train/trainer.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "io/safetensors.h"
#include "testing/cuda_compare.h"
#include "testing/error_message.h"
#include "testing/gpu.h"
#include "testing/test_data.h"
#include "train/checkpoint.h"
#include "train/data/indexed_dataset.h"

namespace moetrain::train {
namespace {

// Documents of the golden model's vocabulary (512) with learnable structure: each counts up from a
// random start by a stride of 1 or 2 through the tokens 1..8, and ends with token 0.
std::string make_dataset(const std::string& dir) {
  const std::string prefix = dir + "/docs";
  data::IndexedDatasetBuilder builder(prefix, 8 /* uint16 */);
  Rng rng(77);
  for (int d = 0; d < 60; ++d) {
    std::vector<int32_t> tokens(static_cast<size_t>(5 + rng.below(40)));
    const int64_t start = static_cast<int64_t>(rng.below(511)), stride = 1 + static_cast<int64_t>(rng.below(2));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(1 + (start + stride * int64_t(i)) % 8);
    tokens.push_back(0);
    builder.add_sequence(tokens);
  }
  builder.finish();
  return prefix;
}

io::JobConfig small_job(const std::string& dir) {
  io::JobConfig c;
  c.model.config = testing::test_data_path("golden/qwen3_moe");
  c.model.init = "random";
  c.data.sources = {{make_dataset(dir), 1.0}};
  c.train.steps = 6;
  c.train.seq_len = 16;
  c.train.micro_batch = 2;
  c.train.global_batch = 4;
  c.optim.lr = 1e-3;
  c.optim.warmup_steps = 2;
  c.loss.load_balance_coef = 0.01;
  c.loss.z_loss_coef = 0.001;
  c.checkpoint.dir = dir + "/ckpt";
  c.checkpoint.every = 3;
  c.checkpoint.keep = 5;
  c.metrics.console_every = 100;
  return c;
}

std::vector<std::vector<float>> weights_of(const Trainer& t) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : t.model().params().all_params()) out.push_back(p.to_vector<float>());
  return out;
}

TEST(Trainer, ResumeAfterStopIsByteIdentical) {
  const std::string dir_a = testing::make_temp_dir("trainer_straight");
  Trainer straight(small_job(dir_a));
  const TrainSummary all = straight.run();
  ASSERT_EQ(all.losses.size(), 6u);

  const std::string dir_b = testing::make_temp_dir("trainer_resumed");
  const io::JobConfig job_b = small_job(dir_b);
  std::vector<double> losses;
  {
    Trainer first(job_b);
    const TrainSummary half = first.run(3);  // the process "dies" after the step-3 checkpoint
    losses = half.losses;
  }
  Trainer resumed(job_b);
  EXPECT_EQ(resumed.steps_done(), 3);
  const TrainSummary rest = resumed.run();
  losses.insert(losses.end(), rest.losses.begin(), rest.losses.end());
  ASSERT_EQ(losses.size(), all.losses.size());
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], all.losses[i]) << "step " << i + 1;
  EXPECT_EQ(weights_of(resumed), weights_of(straight));
  EXPECT_EQ(list_checkpoints(dir_b + "/ckpt"), (std::vector<int64_t>{3, 6}));
}

// optim.state_dtype = bf16: the moments live and are checkpointed in bf16, a stop and resume gives the straight run's
// bytes, and the run tracks the f32 moments' run (the first two losses are the same bits: the first update uses the
// moments before they are stored).
TEST(Trainer, Bf16MomentsResumeByteIdenticalAndTrackTheF32Run) {
  const std::string dir_f32 = testing::make_temp_dir("trainer_moments_f32");
  Trainer f32(small_job(dir_f32));
  const TrainSummary reference = f32.run();

  const auto bf16_job = [](const std::string& dir) {
    io::JobConfig job = small_job(dir);
    job.optim.state_dtype = "bf16";
    return job;
  };
  const std::string dir_a = testing::make_temp_dir("trainer_moments_bf16");
  Trainer straight(bf16_job(dir_a));
  const TrainSummary all = straight.run();
  ASSERT_EQ(all.losses.size(), reference.losses.size());
  for (const Tensor& m : straight.optimizer().exp_avg_sq()) EXPECT_EQ(m.dtype(), DType::BF16);
  EXPECT_EQ(all.losses[0], reference.losses[0]);
  EXPECT_EQ(all.losses[1], reference.losses[1]);
  bool moved = false;
  for (size_t i = 0; i < all.losses.size(); ++i) {
    EXPECT_NEAR(all.losses[i], reference.losses[i], 1e-2 * reference.losses[i]) << "step " << i + 1;
    moved = moved || all.losses[i] != reference.losses[i];
  }
  EXPECT_TRUE(moved) << "bf16 moments gave the f32 run's losses: the option did not take effect";
  const CheckpointData saved = load_checkpoint(*find_latest_checkpoint(dir_a + "/ckpt"));
  for (const auto& [name, tensor] : saved.optimizer) EXPECT_EQ(tensor.dtype(), DType::BF16) << name;

  const std::string dir_b = testing::make_temp_dir("trainer_moments_bf16_resumed");
  const io::JobConfig job_b = bf16_job(dir_b);
  std::vector<double> losses = Trainer(job_b).run(3).losses;
  Trainer resumed(job_b);
  const TrainSummary rest = resumed.run();
  losses.insert(losses.end(), rest.losses.begin(), rest.losses.end());
  EXPECT_EQ(losses, all.losses);
  EXPECT_EQ(weights_of(resumed), weights_of(straight));
}

TEST(Trainer, WarnsOfBf16MomentsWithABeta2WhoseDecayRoundsAway) {
  io::JobConfig job = small_job(testing::make_temp_dir("trainer_moments_beta2"));
  job.optim.state_dtype = "bf16";
  job.optim.beta2 = 0.999;
  ::testing::internal::CaptureStderr();
  { Trainer trainer(job); }
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("optim.beta2 = 0.999"), std::string::npos) << warned;
  EXPECT_NE(warned.find("rounds away in bf16"), std::string::npos) << warned;
  job.optim.beta2 = 0.95;
  ::testing::internal::CaptureStderr();
  { Trainer trainer(job); }
  const std::string quiet = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(quiet.find("rounds away"), std::string::npos) << quiet;
}

// A checkpoint keeps its moments in the dtype its job had; a job with the other optim.state_dtype resumes it with the
// moments converted (f32 -> bf16 rounded to nearest even) and says so.
TEST(Trainer, ResumeConvertsTheMomentsToTheJobsStateDtype) {
  const std::string dir = testing::make_temp_dir("trainer_moments_convert");
  io::JobConfig job = small_job(dir);
  Trainer(job).run(3);
  const CheckpointData saved = load_checkpoint(*find_latest_checkpoint(job.checkpoint.dir));
  job.optim.state_dtype = "bf16";
  ::testing::internal::CaptureStderr();
  Trainer resumed(job);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(resumed.steps_done(), 3);
  EXPECT_NE(log.find("AdamW moments converted to bf16"), std::string::npos) << log;
  const std::map<std::string, Tensor> stored(saved.optimizer.begin(), saved.optimizer.end());
  const auto& specs = resumed.model().params().specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_TRUE(
        testing::same_bytes(resumed.optimizer().exp_avg()[i], stored.at("exp_avg/" + specs[i].name).to(DType::BF16)))
        << specs[i].name;
    EXPECT_TRUE(testing::same_bytes(resumed.optimizer().exp_avg_sq()[i],
                                    stored.at("exp_avg_sq/" + specs[i].name).to(DType::BF16)))
        << specs[i].name;
  }
  EXPECT_EQ(resumed.run().losses.size(), 3u);
}

// Moments in a dtype neither optim.state_dtype takes (f16), or of another shape, are refused by name.
TEST(Trainer, ResumeRefusesMomentsOfAnotherDtypeOrShape) {
  const std::string dir = testing::make_temp_dir("trainer_bad_moments");
  io::JobConfig job = small_job(dir);
  Trainer(job).run(3);
  const CheckpointData good = load_checkpoint(job.checkpoint.dir + "/step_00000003");
  CheckpointData f16 = good;
  f16.optimizer[0].second = f16.optimizer[0].second.to(DType::F16);
  f16.step = 4;
  f16.state["step"] = 4;
  save_checkpoint(job.checkpoint.dir, f16, 0);
  const std::string name = good.optimizer[0].first;
  testing::expect_error([&] { Trainer bad(job); }, {"optimizer state '" + name + "'", "f16[", "or bf16["});
  CheckpointData reshaped = good;
  reshaped.optimizer[0].second = Tensor::zeros({3}, DType::F32);
  reshaped.step = 5;
  reshaped.state["step"] = 5;
  save_checkpoint(job.checkpoint.dir, reshaped, 0);
  testing::expect_error([&] { Trainer bad(job); }, {"optimizer state '" + name + "'", "f32[3]", "was expected"});
}

// A byte changed in place keeps every size, so only load_checkpoint's hashes see it: the resume skips that
// checkpoint with a warning naming it and takes the previous good one (docs/training.md, "Checkpoints").
TEST(Trainer, ResumeSkipsACorruptCheckpointForThePreviousGoodOne) {
  const std::string dir = testing::make_temp_dir("trainer_corrupt_resume");
  const io::JobConfig job = small_job(dir);
  Trainer(job).run();
  ASSERT_EQ(list_checkpoints(job.checkpoint.dir), (std::vector<int64_t>{3, 6}));
  const std::string file = job.checkpoint.dir + "/step_00000006/model.safetensors";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  bytes[bytes.size() - 3] ^= 0x10;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  ::testing::internal::CaptureStderr();
  const Trainer resumed(job);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(resumed.steps_done(), 3);
  EXPECT_NE(log.find("skipping"), std::string::npos) << log;
  EXPECT_NE(log.find("step_00000006"), std::string::npos) << log;
  EXPECT_NE(log.find("model.safetensors"), std::string::npos) << log;
}

// Issue 20: a checkpoint whose state.json says another step than its folder (and manifest), or more optimizer
// steps than steps, is refused by name rather than resumed (which would later overwrite a good checkpoint).
TEST(Trainer, ResumeRefusesAStateThatDisagreesWithItsFolder) {
  const std::string dir = testing::make_temp_dir("trainer_bad_state");
  io::JobConfig job = small_job(dir);
  Trainer(job).run(3);
  const CheckpointData good = load_checkpoint(job.checkpoint.dir + "/step_00000003");
  CheckpointData moved = good;
  moved.step = 6;  // a consistent folder and manifest for step 6, holding step 3's state.json
  save_checkpoint(job.checkpoint.dir, moved, 0);
  try {
    Trainer bad(job);
    ADD_FAILURE() << "a state.json at step 3 inside step_00000006 was resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state.json says step 3, the folder name says step 6"), std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(job.checkpoint.dir + "/step_00000006");
  CheckpointData runaway = good;
  runaway.state["optimizer_steps"] = int64_t{1} << 62;
  save_checkpoint(job.checkpoint.dir, runaway, 0);
  try {
    Trainer bad(job);
    ADD_FAILURE() << "optimizer_steps = 2^62 was resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer_steps 4611686018427387904 after step 3"), std::string::npos)
        << e.what();
  }
  runaway.state["optimizer_steps"] = "three";
  save_checkpoint(job.checkpoint.dir, runaway, 0);
  try {
    Trainer bad(job);
    ADD_FAILURE() << "a string optimizer_steps was resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state.json field 'optimizer_steps' is \"three\""), std::string::npos)
        << e.what();
  }
}

TEST(Trainer, LossFallsAndMetricsAreLogged) {
  const std::string dir = testing::make_temp_dir("trainer_learns");
  io::JobConfig job = small_job(dir);
  job.train.steps = 12;
  job.optim.lr = 3e-3;
  job.checkpoint.dir.clear();
  job.metrics.jsonl = dir + "/metrics.jsonl";
  Trainer trainer(job);
  const TrainSummary s = trainer.run();
  EXPECT_LT(s.losses.back(), s.losses.front() - 0.5);
  std::ifstream in(job.metrics.jsonl);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    const auto record = nlohmann::json::parse(line);
    for (const char* key :
         {"step", "loss", "lb_loss", "grad_norm", "lr", "tokens", "tokens_per_s", "peak_mem_bytes", "elapsed_s"}) {
      EXPECT_TRUE(record.contains(key)) << key;
    }
    EXPECT_EQ(record["step"].get<int>(), lines);
    EXPECT_EQ(record["loss"].get<double>(), s.losses[static_cast<size_t>(lines - 1)]);
    EXPECT_GT(record["lb_loss"].get<double>(), 0.9);  // 1.0 is perfect balance; it cannot go below
  }
  EXPECT_EQ(lines, 12);
}

// Reads every record of a metrics JSONL file.
std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  return records;
}

// DeepSeek-V2's device-level balance over 4 groups of the golden model's 8 experts: the step reports it (JSONL key
// device_balance, between the balanced 1.0's neighbourhood and the collapsed D = 4), its gradient changes the
// training, and a run without it has no such key (the other keys are unchanged).
TEST(Trainer, DeviceBalanceLossTrainsAndIsLogged) {
  const std::string dir = testing::make_temp_dir("trainer_device_balance");
  io::JobConfig job = small_job(dir);
  job.train.steps = 4;
  job.checkpoint.dir.clear();
  io::JobConfig with = job, without = job;
  with.loss.device_balance_coef = 0.5;
  with.loss.device_balance_groups = 4;
  with.metrics.jsonl = dir + "/with.jsonl";
  without.metrics.jsonl = dir + "/without.jsonl";
  Trainer on(with), off(without);
  const TrainSummary s_on = on.run(), s_off = off.run();
  EXPECT_EQ(s_on.losses.front(), s_off.losses.front()) << "the first step's cross-entropy comes before any update";
  EXPECT_NE(weights_of(on), weights_of(off)) << "the device-balance gradient must reach the parameters";
  const std::vector<nlohmann::json> records = read_jsonl(with.metrics.jsonl);
  ASSERT_EQ(records.size(), 4u);
  for (const nlohmann::json& record : records) {
    ASSERT_TRUE(record.contains("device_balance")) << record.dump();
    const double value = record["device_balance"].get<double>();
    EXPECT_GT(value, 0.9) << "1.0 is balanced over the groups";  // as lb_loss: near 1 at random init
    EXPECT_LE(value, 4.0) << "D = 4 when every choice and all probability go to one group";
    EXPECT_TRUE(record.contains("lb_loss") && record.contains("z_loss"));
  }
  for (const nlohmann::json& record : read_jsonl(without.metrics.jsonl)) {
    EXPECT_FALSE(record.contains("device_balance")) << record.dump();
    EXPECT_TRUE(record.contains("lb_loss") && record.contains("z_loss"));
  }
}

// The device balance's groups must divide the experts: refused when the trainer loads the model, naming the key.
TEST(Trainer, RefusesDeviceBalanceGroupsThatDoNotDivideTheExperts) {
  const std::string dir = testing::make_temp_dir("trainer_device_groups");
  io::JobConfig job = small_job(dir);
  job.loss.device_balance_coef = 0.05;
  job.loss.device_balance_groups = 3;
  testing::expect_error([&] { Trainer trainer(job); },
                        {"loss.device_balance_groups", "3 groups", "8 experts", "divisor of 8"});
}

// The golden trajectory (5 AdamW steps of 2 micro-batches, clip 1.0, lr 1e-3, betas (0.9, 0.95),
// weight decay 0.1 on matrices) run by the Trainer with the reference's own micro-batches.
TEST(Trainer, GoldenTrajectoryMatchesTransformers) {
  const std::string dir = testing::make_temp_dir("trainer_golden");
  io::JobConfig job = small_job(dir);
  job.model.init = "pretrained";
  job.train.steps = 5;
  job.optim.lr = 1e-3;
  job.optim.schedule = "constant";
  job.optim.warmup_steps = 0;
  job.optim.beta1 = 0.9;
  job.optim.beta2 = 0.95;
  job.optim.eps = 1e-8;
  job.optim.weight_decay = 0.1;
  job.optim.clip_grad_norm = 1.0;
  job.loss.load_balance_coef = 0.0;
  job.loss.z_loss_coef = 0.0;
  job.checkpoint.dir.clear();
  const auto ref = io::SafetensorsReader::open(testing::test_data_path("golden/qwen3_moe/reference.safetensors"));
  Trainer trainer(job);
  trainer.use_batch_source([&](int64_t step) {
    std::vector<model::MicroBatch> batches;
    for (int mb = 0; mb < 2; ++mb) {
      const std::string key = "traj.step" + std::to_string(step) + ".mb" + std::to_string(mb) + ".";
      batches.push_back(model::MicroBatch::from_rows(ref.tensor(key + "input_ids"), ref.tensor(key + "targets")));
    }
    return batches;
  });
  const TrainSummary s = trainer.run();
  const auto ref_loss = ref.tensor("traj.loss").to_vector<float>();
  const auto ref_norm = ref.tensor("traj.grad_norm").to_vector<float>();
  ASSERT_EQ(s.losses.size(), ref_loss.size());
  for (size_t i = 0; i < s.losses.size(); ++i) {
    EXPECT_NEAR(s.losses[i], ref_loss[i], 1e-5 * ref_loss[i]) << "step " << i;
    EXPECT_NEAR(s.grad_norms[i], ref_norm[i], 1e-4 * ref_norm[i]) << "step " << i;
  }
  const auto exported = trainer.model().params().export_hf_runtime(
      false, [&](const std::string& fused) { return ref.contains("traj.final." + fused); });
  for (const auto& [name, tensor] : exported) {
    EXPECT_LT(testing::relative_error(tensor, ref.tensor("traj.final." + name).clone()), 1e-4) << name;
  }
}

TEST(Trainer, NanLossStopsBeforeAnyCheckpointIsWritten) {
  const std::string dir = testing::make_temp_dir("trainer_nan");
  // A model folder whose final norm holds a NaN is refused when it is loaded (issue 20: imported weights must be
  // finite), so the NaN goes into the final norm after loading: the first loss is NaN.
  const std::string model_dir = dir + "/model";
  std::filesystem::create_directories(model_dir);
  std::filesystem::copy_file(testing::test_data_path("golden/qwen3_moe/config.json"), model_dir + "/config.json");
  const auto reader = io::SafetensorsReader::open(testing::test_data_path("golden/qwen3_moe/model.safetensors"));
  std::vector<std::pair<std::string, Tensor>> weights;
  for (const auto& name : reader.names()) weights.emplace_back(name, reader.tensor(name).clone());
  for (auto& [name, t] : weights) {
    if (name == "model.norm.weight") t.data<float>()[3] = NAN;
  }
  io::write_safetensors(model_dir + "/model.safetensors", weights);
  io::JobConfig job = small_job(dir);
  job.model.config = model_dir;
  job.model.init = "pretrained";
  job.checkpoint.every = 1;
  try {
    Trainer refused(job);
    ADD_FAILURE() << "a NaN weight was loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'model.norm.weight' holds a non-finite value (nan)"), std::string::npos)
        << e.what();
  }
  job.model.config = testing::test_data_path("golden/qwen3_moe");
  Trainer trainer(job);
  trainer.model().params().param("final_norm").data<float>()[3] = NAN;  // the master (f32 compute reads it)
  try {
    trainer.run();
    FAIL() << "expected the NaN loss to stop the run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step 1: the loss is nan"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(list_checkpoints(dir + "/ckpt").empty());
}

// A checkpoint of a GPU run holds CPU tensors (the AdamW moments live on the device) and resumes byte for byte.
TEST(CudaTrainer, SavesAndResumesACheckpointOfABf16Run) {
  MT_REQUIRE_GPU();
  const std::string dir_a = testing::make_temp_dir("cuda_trainer_straight");
  io::JobConfig a = small_job(dir_a);
  a.model.device = "cuda";
  a.model.compute_dtype = "bf16";
  Trainer straight(a);
  const TrainSummary all = straight.run();
  ASSERT_EQ(all.losses.size(), 6u);
  EXPECT_EQ(list_checkpoints(a.checkpoint.dir), (std::vector<int64_t>{3, 6}));

  const std::string dir_b = testing::make_temp_dir("cuda_trainer_resumed");
  io::JobConfig b = a;
  b.checkpoint.dir = dir_b + "/ckpt";
  b.data.sources = {{make_dataset(dir_b), 1.0}};
  {
    Trainer first(b);
    first.run(3);
  }
  Trainer second(b);
  EXPECT_EQ(second.steps_done(), 3);
  const TrainSummary rest = second.run();
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.losses[i], all.losses[3 + i]) << "step " << 4 + i;
  EXPECT_EQ(weights_of(second), weights_of(straight));
}

}  // namespace
}  // namespace moetrain::train
