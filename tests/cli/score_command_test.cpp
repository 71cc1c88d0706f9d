// Tests for `moetrain score` and the exact lanes' byte gates on the CPU (tiny example model, random
// init, exact mode): packing, padding and training-vs-score give the same bytes (a packed micro-batch
// of the training loader is a valid score input: both keep documents within rows); the command's
// output file is the same bytes for every pp x ep (x dp) mesh on thread ranks and reproducible; every
// malformed input or unsupported layout is refused and leaves no file.
#include "cli/score_command.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli/commands.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "ops/loss.h"
#include "pipeline/plain_executor.h"
#include "testing/exact_scoring.h"
#include "testing/test_data.h"
#include "train/checkpoint.h"
#include "train/data/indexed_dataset.h"
#include "train/data/loader.h"

namespace moetrain::cli {
namespace {

namespace fs = std::filesystem;

using testing::Layout;
using testing::score_on_layout;
using testing::write_layout_input;

constexpr int64_t kVocab = testing::kScoreVocab;

std::vector<int32_t> tokens(int64_t n, uint64_t salt) { return testing::score_tokens(n, salt); }
ScoreInput make_input(const std::vector<int32_t>& ids, int64_t rows, const std::vector<int32_t>& cu = {}) {
  return testing::score_input(ids, rows, cu);
}
void expect_same_bytes(const Tensor& a, int64_t a_at, const Tensor& b, int64_t b_at, int64_t count,
                       const std::string& what) {
  testing::expect_same_float_bytes(a, a_at, b, b_at, count, what);
}
std::string read_bytes(const std::string& path) { return testing::read_file_bytes(path); }

std::string tiny_moe_config_path() {
  return testing::repo_path("examples/tiny_moe/config.json");
}

// A job on the tiny example (8 layers, random init from seed 1234), micro-batches of 2 rows.
std::string write_job(const std::string& dir, const std::string& extra = "") {
  const std::string path = dir + "/job.toml";
  std::ofstream(path) << "[model]\nconfig = \"" << tiny_moe_config_path()
                      << "\"\ninit = \"random\"\n[data]\nmode = \"synthetic\"\n[train]\nsteps = 1\nseq_len = 32\n"
                         "micro_batch = 2\nseed = 1234\n"
                      << extra;
  return path;
}

io::JobConfig exact_job(const std::string& dir) { return io::load_job_config(write_job(dir), {"exact.enabled=true"}); }

std::unique_ptr<model::CausalLm> exact_model(const io::JobConfig& job) {
  auto model = load_model_for_job(job);
  model->set_exact(true);
  return model;
}

int run(std::vector<std::string> args) {
  args.insert(args.begin(), "moetrain");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_main(static_cast<int>(argv.size()), argv.data());
}

TEST(ScoreExact, PackedDocumentsGiveTheBytesOfEachDocumentAlone) {
  const std::string dir = testing::make_temp_dir("score_packed");
  const io::JobConfig job = exact_job(dir);
  const auto model = exact_model(job);
  // Two rows of 24 tokens: row 0 packs documents of 7, 10 and 7 tokens, row 1 of 5 and 19.
  const std::vector<int32_t> ids = tokens(48, 1);
  const std::vector<int32_t> cu = {0, 7, 17, 24, 29, 48};
  const Tensor packed = score_logprobs(*model, make_input(ids, 2, cu), job.train.micro_batch, true);
  ASSERT_EQ(packed.shape(), (Shape{2, 23}));
  const float* p = packed.data<float>();
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t begin = cu[d], end = cu[d + 1], len = end - begin;
    const int64_t row = begin / 24, col = begin % 24;
    const std::vector<int32_t> alone_ids(ids.begin() + begin, ids.begin() + end);
    const Tensor alone = score_logprobs(*model, make_input(alone_ids, 1), 1, true);
    ASSERT_EQ(alone.shape(), (Shape{1, len - 1}));
    expect_same_bytes(packed, row * 23 + col, alone, 0, len - 1, "document " + std::to_string(d));
    // The document's last token predicts nothing: +0.0 (unless it is the row's last, which is dropped).
    if ((end % 24) != 0) {
      EXPECT_EQ(p[row * 23 + (end - 1) % 24], 0.0f) << d;
      EXPECT_FALSE(std::signbit(p[row * 23 + (end - 1) % 24])) << d;
    }
  }
  for (int64_t i = 0; i < packed.numel(); ++i) EXPECT_LE(p[i], 0.0f) << i;
}

TEST(ScoreExact, PaddingTheBatchLeavesTheBytesOfRealTokensUnchanged) {
  const std::string dir = testing::make_temp_dir("score_padding");
  const io::JobConfig job = exact_job(dir);
  const auto model = exact_model(job);
  const std::vector<int32_t> real = tokens(16, 2);
  const Tensor alone = score_logprobs(*model, make_input(real, 1), 1, true);

  // Extra rows of other tokens around the real row, in micro-batches of 2 and of 3 rows.
  std::vector<int32_t> rows = tokens(16, 3);
  rows.insert(rows.end(), real.begin(), real.end());
  const std::vector<int32_t> after = tokens(32, 4);
  rows.insert(rows.end(), after.begin(), after.end());
  for (const int64_t micro : {2, 3}) {
    const Tensor padded = score_logprobs(*model, make_input(rows, 4), micro, true);
    expect_same_bytes(padded, 1 * 15, alone, 0, 15, "padding rows, micro-batch " + std::to_string(micro));
  }

  // A longer row: the real tokens followed by a padding document of 8 other tokens.
  std::vector<int32_t> longer = real;
  const std::vector<int32_t> pad = tokens(8, 5);
  longer.insert(longer.end(), pad.begin(), pad.end());
  const Tensor padded = score_logprobs(*model, make_input(longer, 1, {0, 16, 24}), 1, true);
  expect_same_bytes(padded, 0, alone, 0, 15, "padding document");
  EXPECT_EQ(padded.data<float>()[15], 0.0f);
  EXPECT_FALSE(std::signbit(padded.data<float>()[15]));
}

TEST(ScoreExact, TrainingForwardLogprobsEqualScoreBytes) {
  const std::string dir = testing::make_temp_dir("score_training");
  const io::JobConfig job = exact_job(dir);
  const auto model = exact_model(job);
  const std::vector<int32_t> ids = tokens(64, 6);
  const std::vector<int32_t> cu = {0, 11, 32, 45, 64};
  const ScoreInput input = make_input(ids, 2, cu);
  const Tensor scored = score_logprobs(*model, input, job.train.micro_batch, true);

  // The training forward on the same tokens: one micro-batch of the two rows, packed as the data
  // loader packs them (targets = next token in the document, -100 at its end), with the router losses.
  std::vector<int32_t> targets(ids.size(), ops::kIgnoreIndex);
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    for (int32_t t = cu[d]; t + 1 < cu[d + 1]; ++t) targets[static_cast<size_t>(t)] = ids[static_cast<size_t>(t + 1)];
  }
  const model::MicroBatch batch = model::MicroBatch::packed(
      Tensor::from_vector(ids, {64}), Tensor::from_vector(targets, {64}), Tensor::from_vector(cu, {5}));
  model::ForwardObservation observe;
  observe.keep_logits = false;  // the head training runs, not materialised logits kept for inspection
  model->params().zero_grads();
  pipeline::forward_backward(*model, {batch}, 0, &observe);
  ASSERT_EQ(observe.token_logprobs.size(), 1u);
  const Tensor& trained = observe.token_logprobs[0];
  for (int64_t r = 0; r < 2; ++r) expect_same_bytes(scored, r * 31, trained, r * 32, 31, "row " + std::to_string(r));
}

TEST(ScoreExact, PackedLoaderMicroBatchIsAScoreInputWithTheTrainingForwardBytes) {
  const std::string dir = testing::make_temp_dir("score_loader");
  const io::JobConfig job = exact_job(dir);
  const auto model = exact_model(job);
  // Documents shorter than a row, longer than a row and longer than a micro-batch (2 rows of 32).
  train::data::IndexedDatasetBuilder builder(dir + "/docs", train::data::IndexDType::Int32);
  uint64_t salt = 20;
  for (const int64_t length : {9, 50, 3, 21, 90, 14, 40, 6}) builder.add_sequence(tokens(length, salt++));
  builder.finish();
  train::data::LoaderOptions options;
  options.sources = {{dir + "/docs", 1.0}};
  options.shuffle = false;
  options.seq_len = job.train.seq_len;
  options.micro_batch = job.train.micro_batch;
  options.vocab_size = kVocab;
  train::data::DataLoader loader(options);
  const int64_t T = job.train.seq_len, rows = job.train.micro_batch;

  int64_t compared = 0;
  for (int m = 0; m < 4; ++m) {
    const model::MicroBatch batch = loader.next();
    // The training batch read as score's input: its tokens as rows of T, its cu_seqlens as the documents.
    ScoreInput input;
    input.input_ids = batch.input_ids.clone().view({rows, T});
    input.cu_seqlens = batch.cu_seqlens.clone();
    ASSERT_NO_THROW(validate_score_input(input, kVocab, "loader micro-batch " + std::to_string(m)));
    const Tensor scored = score_logprobs(*model, input, rows, true);

    model::ForwardObservation observe;
    model->params().zero_grads();
    pipeline::forward_backward(*model, {batch}, 0, &observe);
    ASSERT_EQ(observe.token_logprobs.size(), 1u);
    const Tensor& trained = observe.token_logprobs[0];
    // Every token but a segment's last: score's target there is the segment's next token, as the loader's is
    // (the loader's target at a segment's last token lies beyond the segment, which score never sees).
    const std::vector<int32_t> cu = batch.cu_seqlens.to_vector<int32_t>();
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      for (int32_t t = cu[d]; t + 1 < cu[d + 1]; ++t, ++compared) {
        expect_same_bytes(scored, (t / T) * (T - 1) + t % T, trained, t, 1,
                          "micro-batch " + std::to_string(m) + " token " + std::to_string(t));
      }
    }
  }
  EXPECT_GT(compared, 200);
}

TEST(Score, CommandWritesTheFileAndASecondRunIsByteIdentical) {
  const std::string dir = testing::make_temp_dir("score_command");
  const std::string job = write_job(dir);
  const std::vector<int32_t> ids = tokens(3 * 20, 7);
  io::write_safetensors(dir + "/in.safetensors",
                        {{"input_ids", Tensor::from_vector(ids, {3, 20})},
                         {"cu_seqlens", Tensor::from_vector<int32_t>({0, 20, 26, 40, 60}, {5})}});
  for (const char* out : {"/a.safetensors", "/b.safetensors"}) {
    ASSERT_EQ(
        run({"score", "--config", job, "--input", dir + "/in.safetensors", "--out", dir + out, "--exact.enabled=true"}),
        0);
  }
  const std::string a = read_bytes(dir + "/a.safetensors");
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, read_bytes(dir + "/b.safetensors"));

  const io::SafetensorsFile file = io::SafetensorsFile::open(dir + "/a.safetensors");
  EXPECT_EQ(file.names(), (std::vector<std::string>{"logprobs"}));
  const Tensor logprobs = file.tensor("logprobs");
  EXPECT_EQ(logprobs.dtype(), DType::F32);
  EXPECT_EQ(logprobs.shape(), (Shape{3, 19}));
  // The same bytes as the in-process path on the job's model.
  const io::JobConfig config = exact_job(dir);
  const Tensor expected =
      score_logprobs(*exact_model(config), make_input(ids, 3, {0, 20, 26, 40, 60}), config.train.micro_batch, true);
  expect_same_bytes(logprobs, 0, expected, 0, expected.numel(), "command vs in-process");
  EXPECT_FALSE(fs::exists(dir + "/a.safetensors.tmp"));
}

TEST(Score, ScoresTheNewestCheckpointOfTheJob) {
  const std::string dir = testing::make_temp_dir("score_checkpoint");
  const std::string job = write_job(dir, "[checkpoint]\ndir = \"ckpt\"\n");
  // A checkpoint whose weights come from another seed than the job's random init.
  io::JobConfig other = io::load_job_config(job, {"train.seed=99"});
  const auto trained = load_model_for_job(other);  // no checkpoint yet: random from seed 99
  train::CheckpointData data;
  data.step = 3;
  data.model = trained->params().export_hf();
  data.state = nlohmann::json::object();
  train::save_checkpoint(dir + "/ckpt", data, 0);

  const std::vector<int32_t> ids = tokens(2 * 12, 8);
  io::write_safetensors(dir + "/in.safetensors", {{"input_ids", Tensor::from_vector(ids, {2, 12})}});
  ASSERT_EQ(run({"score", "--config", job, "--input", dir + "/in.safetensors", "--out", dir + "/out.safetensors"}), 0);
  const Tensor scored = io::SafetensorsFile::open(dir + "/out.safetensors").tensor("logprobs");
  const Tensor expected = score_logprobs(*trained, make_input(ids, 2), 2);
  expect_same_bytes(scored, 0, expected, 0, expected.numel(), "checkpoint weights");
  const io::JobConfig fresh = io::load_job_config(write_job(testing::make_temp_dir("score_fresh")), {});
  const Tensor seed_1234 = score_logprobs(*load_model_for_job(fresh), make_input(ids, 2), 2);
  EXPECT_NE(std::memcmp(scored.raw_data(), seed_1234.raw_data(), scored.nbytes()), 0);
}

// Writes `tensors` as the input, runs score expecting an Error holding every needle, and checks
// that no output file (nor its temporary) was left behind.
void expect_refused(const std::string& tag, const std::vector<std::pair<std::string, Tensor>>& tensors,
                    std::initializer_list<std::string> needles, std::vector<std::string> overrides = {}) {
  const std::string dir = testing::make_temp_dir("score_refuse_" + tag);
  ScoreOptions options;
  options.config_path = write_job(dir);
  options.input = dir + "/in.safetensors";
  options.out = dir + "/out.safetensors";
  options.overrides = std::move(overrides);
  io::write_safetensors(options.input, tensors);
  try {
    run_score(options);
    ADD_FAILURE() << tag << ": expected an error holding '" << *needles.begin() << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& needle : needles)
      EXPECT_NE(message.find(needle), std::string::npos) << tag << ": '" << message << "' lacks '" << needle << "'";
  }
  EXPECT_FALSE(fs::exists(options.out)) << tag;
  EXPECT_FALSE(fs::exists(options.out + ".tmp")) << tag;
}

Tensor ids_2x8() { return Tensor::from_vector(tokens(16, 9), {2, 8}); }
Tensor cu(std::vector<int32_t> v) {
  const int64_t n = static_cast<int64_t>(v.size());
  return Tensor::from_vector(v, {n});
}

TEST(Score, RefusesEveryMalformedInputAndWritesNothing) {
  expect_refused("missing_ids", {{"cu_seqlens", cu({0, 8, 16})}}, {"no tensor 'input_ids'", "int32 [B, T]"});
  std::vector<int64_t> wide(16, 1);
  expect_refused("int64_ids", {{"input_ids", Tensor::from_vector(wide, {2, 8})}},
                 {"'input_ids' must be int32 [B, T]", "i64"});
  expect_refused("1d_ids", {{"input_ids", Tensor::from_vector(tokens(16, 9), {16})}},
                 {"'input_ids' must be 2-D [B, T]", "[16]"});
  expect_refused("short_rows", {{"input_ids", Tensor::from_vector(tokens(3, 9), {3, 1})}}, {"T >= 2"});
  expect_refused("int64_cu", {{"input_ids", ids_2x8()}, {"cu_seqlens", Tensor::from_vector<int64_t>({0, 8, 16}, {3})}},
                 {"'cu_seqlens' must be int32", "i64"});
  expect_refused("2d_cu",
                 {{"input_ids", ids_2x8()}, {"cu_seqlens", Tensor::from_vector<int32_t>({0, 8, 8, 16}, {2, 2})}},
                 {"'cu_seqlens' must be 1-D"});
  expect_refused("one_entry_cu", {{"input_ids", ids_2x8()}, {"cu_seqlens", cu({16})}}, {">= 2 entries", "has 1"});
  expect_refused("start", {{"input_ids", ids_2x8()}, {"cu_seqlens", cu({1, 8, 16})}},
                 {"must start at 0", "cu_seqlens[0] is 1"});
  expect_refused("end", {{"input_ids", ids_2x8()}, {"cu_seqlens", cu({0, 8, 12})}},
                 {"must end at B * T = 2 * 8 = 16", "ends at 12"});
  expect_refused("increasing", {{"input_ids", ids_2x8()}, {"cu_seqlens", cu({0, 5, 5, 8, 16})}},
                 {"strictly increasing", "cu_seqlens[2] = 5 is not greater than cu_seqlens[1] = 5"});
  expect_refused("row_boundary", {{"input_ids", ids_2x8()}, {"cu_seqlens", cu({0, 5, 10, 16})}},
                 {"lacks the row boundary 8", "row 1"});
  std::vector<int32_t> bad = tokens(16, 9);
  bad[11] = static_cast<int32_t>(kVocab);
  expect_refused("vocab", {{"input_ids", Tensor::from_vector(bad, {2, 8})}},
                 {"'input_ids'[1, 3] = 257 is outside the vocabulary [0, 257)"});
  bad[11] = -1;
  expect_refused("negative", {{"input_ids", Tensor::from_vector(bad, {2, 8})}}, {"'input_ids'[1, 3] = -1"});
  expect_refused("extra", {{"input_ids", ids_2x8()}, {"labels", ids_2x8()}}, {"unexpected tensor 'labels'"});
}

TEST(Score, RefusesContextParallelAndAWorldTheMeshDoesNotDivide) {
  expect_refused("cp2", {{"input_ids", ids_2x8()}}, {"parallel.cp = 2", "not supported by score"}, {"parallel.cp=2"});
  // One process alone is a world of 1: pp = 2 cannot cut it.
  expect_refused("pp2_alone", {{"input_ids", ids_2x8()}}, {"world size 1 is not divisible by pp (2)"},
                 {"parallel.pp=2"});
  expect_refused("pp2_of_3", {{"input_ids", ids_2x8()}}, {"world size 3 is not divisible by pp (2) x cp (1) x ep (1)"},
                 {"parallel.pp=2", "dist.local_ranks=3"});
  expect_refused("ep3", {{"input_ids", ids_2x8()}}, {"num_experts (8) is not divisible by parallel.ep (3)"},
                 {"parallel.ep=3", "dist.local_ranks=3"});
  // pp = 8 needs 16 stages of >= 1 layer: the 8-layer model is refused before any weight is read.
  expect_refused("pp8", {{"input_ids", ids_2x8()}}, {"pp = 8 needs 16 stages", "the model has 8 layers"},
                 {"parallel.pp=8", "dist.local_ranks=8"});
}

const std::vector<Layout>& mesh_layouts() {
  static const std::vector<Layout> layouts = {{1, 2, 1}, {2, 1, 1}, {2, 2, 1}, {4, 1, 1},
                                              {4, 2, 1}, {1, 1, 3}, {2, 2, 2}, {1, 2, 2}};
  return layouts;
}

// The gate of docs/design.md section 6 through the command: the output FILE of score is the same bytes whatever the
// mesh, pp in {1, 2, 4} x ep in {1, 2} (and data parallelism: more data ranks than micro-batches, padding
// repeats), against one process at pp = 1.
TEST(ScoreExact, OutputFileIsByteIdenticalForEveryPipelineAndExpertLayout) {
  const std::string dir = testing::make_temp_dir("score_layouts_exact");
  write_job(dir);
  const std::string input = write_layout_input(dir);
  const std::string reference = read_bytes(score_on_layout(dir, input, {1, 1, 1}, {"exact.enabled=true"}));
  ASSERT_FALSE(reference.empty());
  const Tensor ref = io::SafetensorsFile::open(dir + "/out_pp1_ep1_dp1.safetensors").tensor("logprobs");
  ASSERT_EQ(ref.shape(), (Shape{5, 19}));
  for (const Layout& layout : mesh_layouts()) {
    const std::string path = score_on_layout(dir, input, layout, {"exact.enabled=true"});
    const std::string bytes = read_bytes(path);
    EXPECT_EQ(bytes.size(), reference.size()) << layout.name() << " wrote a file of another size";
    EXPECT_TRUE(bytes == reference) << layout.name() << ": the score file differs from pp 1 x ep 1 x dp 1 ("
                                    << "max |diff| of the logprobs "
                                    << testing::max_abs_diff(io::SafetensorsFile::open(path).tensor("logprobs"), ref)
                                    << ")";
    EXPECT_FALSE(fs::exists(path + ".tmp")) << layout.name();
  }
}

// Without exact mode (plain f32 program, f32 wire) the layouts agree with one process at pp = 1 within 1e-6
// absolute per log-prob. (On the CPU they are in fact the same bits: batch-invariant kernels and an f32 wire; the
// test pins the documented tolerance.)
TEST(Score, PipelineAndExpertLayoutsMatchOneProcessInF32) {
  const std::string dir = testing::make_temp_dir("score_layouts_f32");
  write_job(dir);
  const std::string input = write_layout_input(dir);
  const Tensor ref = io::SafetensorsFile::open(score_on_layout(dir, input, {1, 1, 1}, {})).tensor("logprobs").clone();
  for (const Layout& layout : {Layout{2, 2, 1}, Layout{4, 1, 1}, Layout{1, 2, 2}}) {
    const Tensor got = io::SafetensorsFile::open(score_on_layout(dir, input, layout, {})).tensor("logprobs");
    ASSERT_EQ(got.shape(), ref.shape()) << layout.name();
    EXPECT_LE(testing::max_abs_diff(got, ref), 1e-6) << layout.name();
  }
}

TEST(Score, SharesMicroBatchesRoundRobinAndPadsForExpertParallel) {
  // 5 micro-batches over 3 data ranks: 0, 3 | 1, 4 | 2.
  EXPECT_EQ(score_share(5, 3, 0, false).micro_batches, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(score_share(5, 3, 2, false).micro_batches, (std::vector<int64_t>{2}));
  EXPECT_EQ(score_share(5, 3, 2, false).real, 1);
  // With equal counts rank 2 repeats micro-batch 2 mod 5 = 2 (dropped).
  const ScoreShare padded = score_share(5, 3, 2, true);
  EXPECT_EQ(padded.micro_batches, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(padded.real, 1);
  // More data ranks than micro-batches: none, or one repeat of micro-batch d mod M.
  EXPECT_TRUE(score_share(2, 4, 3, false).micro_batches.empty());
  const ScoreShare spare = score_share(2, 4, 3, true);
  EXPECT_EQ(spare.micro_batches, (std::vector<int64_t>{1}));
  EXPECT_EQ(spare.real, 0);
  EXPECT_THROW(score_share(0, 2, 0, false), Error);
  EXPECT_THROW(score_share(3, 2, 2, false), Error);
}

TEST(ScoreExact, RefusesAJobTheContractDoesNotAdmit) {
  // A global-batch load-balance loss has no pipeline path; a cut that leaves a stage empty.
  expect_refused("exact_loss", {{"input_ids", ids_2x8()}}, {"exact: refused", "load-balance"},
                 {"exact.enabled=true", "loss.load_balance=global_batch", "loss.load_balance_coef=0.01"});
  expect_refused("exact_cuts", {{"input_ids", ids_2x8()}}, {"parallel.pp_cuts"},
                 {"exact.enabled=true", "parallel.pp_cuts=[9]"});
}

}  // namespace
}  // namespace moetrain::cli
