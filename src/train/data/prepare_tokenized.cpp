// defines: prepare_tokenized, `data prepare --tokenizer`: JSONL text read in blocks on the calling thread, each block
// parsed and BPE-encoded by a worker (one BpeEncoder each), blocks written in input order into an
// IndexedDatasetBuilder, with progress reports. Any error (the first in input order) removes every output.
#include "train/data/prepare.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/data/bpe_tokenizer.h"
#include "train/data/jsonl.h"

namespace moetrain::train::data {

namespace fs = std::filesystem;

namespace {

constexpr size_t kBlockBytes = size_t{1} << 20;  // input bytes per block
constexpr size_t kBlockLines = 4096;

struct Block {
  std::vector<std::string> lines;
  int64_t first_line = 0;  // line number of lines[0]
  int64_t bytes = 0;
  // Results, valid once done.
  std::vector<int32_t> ids;    // every document's ids, EOD included, back to back
  std::vector<int64_t> sizes;  // tokens of each document
  int64_t skipped = 0;         // empty documents
  std::exception_ptr error;
  bool done = false;
};

// Workers that encode blocks; the destructor stops and joins them (pending blocks are dropped).
class EncoderPool {
 public:
  EncoderPool(const BpeTokenizer& tokenizer, int threads, const std::string& file, const std::string& field,
              int32_t eod)
      : tokenizer_(tokenizer), file_(file), field_(field), eod_(eod) {
    for (int t = 0; t < threads; ++t) threads_.emplace_back([this] { work(); });
  }
  EncoderPool(const EncoderPool&) = delete;
  EncoderPool& operator=(const EncoderPool&) = delete;
  ~EncoderPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void submit(std::shared_ptr<Block> block) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(block));
    }
    work_ready_.notify_one();
  }

  void wait(const Block& block) {
    std::unique_lock lock(mutex_);
    block_done_.wait(lock, [&] { return block.done; });
  }

 private:
  void work() {
    BpeEncoder encoder(tokenizer_);
    for (;;) {
      std::shared_ptr<Block> block;
      {
        std::unique_lock lock(mutex_);
        work_ready_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        block = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        encode(*block, encoder);
      } catch (...) {
        block->error = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        block->done = true;
      }
      block_done_.notify_all();
    }
  }

  void encode(Block& block, BpeEncoder& encoder) const {
    for (size_t k = 0; k < block.lines.size(); ++k) {
      const std::string& line = block.lines[k];
      if (line.find_first_not_of(" \t\r\f\v") == std::string::npos) continue;
      const std::string where = fmt::format("{}:{}", file_, block.first_line + static_cast<int64_t>(k));
      const nlohmann::json object = parse_jsonl_object(line, where);
      const auto it = object.find(field_);
      MT_CHECK(it != object.end(),
               "{}: missing field \"{}\" (expected a text string; --text-field picks another field)", where, field_);
      MT_CHECK(it->is_string(), "{}: field \"{}\" is {} (expected a text string)", where, field_, it->type_name());
      const size_t first = block.ids.size();
      encoder.encode(it->get_ref<const std::string&>(), block.ids);
      if (block.ids.size() == first) {
        ++block.skipped;
        continue;
      }
      block.ids.push_back(eod_);
      block.sizes.push_back(static_cast<int64_t>(block.ids.size() - first));
    }
  }

  const BpeTokenizer& tokenizer_;
  std::string file_, field_;
  int32_t eod_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable work_ready_, block_done_;
  std::deque<std::shared_ptr<Block>> queue_;
  bool stop_ = false;
};

// Creates the output's parent folders; unless release() is called, removes the topmost one it created.
class CreatedFolder {
 public:
  explicit CreatedFolder(const fs::path& parent) {
    if (parent.empty()) return;
    std::error_code ec;
    fs::path top;
    for (fs::path p = parent; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
      top = p;
      if (p == p.parent_path()) break;
    }
    fs::create_directories(parent, ec);
    MT_CHECK(!ec, "data prepare: cannot create the output folder {}: {}", parent.string(), ec.message());
    top_ = top;
  }
  CreatedFolder(const CreatedFolder&) = delete;
  CreatedFolder& operator=(const CreatedFolder&) = delete;
  ~CreatedFolder() {
    if (!top_.empty()) {
      std::error_code ec;
      fs::remove_all(top_, ec);
    }
  }
  void release() { top_.clear(); }

 private:
  fs::path top_;
};

}  // namespace

PrepareSummary prepare_tokenized(const PrepareOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  MT_CHECK(!options.output.empty(), "data prepare: no output prefix (expected --output PREFIX)");
  MT_CHECK(!options.input.empty() && options.text_files.empty(),
           "data prepare: --tokenizer encodes JSONL text (expected --input FILE.jsonl{})",
           options.text_files.empty() ? "" : ", not --text");
  MT_CHECK(options.threads >= 0, "data prepare: --threads is {} (expected 0 for one per hardware thread, or more)",
           options.threads);
  const std::string field = options.text_field.empty() ? "text" : options.text_field;

  const BpeTokenizer tokenizer = BpeTokenizer::load(options.tokenizer);
  const EodChoice eod = choose_eod(tokenizer, options.tokenizer, options.eod);
  const int64_t max_possible = tokenizer.vocab_size() - 1;
  PrepareSummary summary;
  if (options.dtype == "auto") {
    summary.dtype = index_dtype_for_max_id(max_possible);
  } else {
    MT_CHECK(options.dtype == "uint16" || options.dtype == "int32",
             "data prepare: --dtype is \"{}\" (expected uint16 or int32)", options.dtype);
    summary.dtype = *index_dtype_from_name(options.dtype);
    MT_CHECK(summary.dtype == IndexDType::Int32 || max_possible <= 65535,
             "data prepare: --dtype uint16 cannot hold the ids of {} (ids up to {}); use --dtype int32 or auto",
             tokenizer.origin(), max_possible);
  }
  summary.eod = eod.id;
  summary.eod_source = eod.source;
  summary.tokenizer = tokenizer.describe();
  summary.tokenizer_note = tokenizer.post_processor_note();

  std::ifstream in(options.input, std::ios::binary);
  MT_CHECK(in.is_open(), "data prepare: cannot open {} (expected a readable file)", options.input);

  CreatedFolder folder(fs::path(options.output).parent_path());
  IndexedDatasetBuilder builder(options.output, summary.dtype);
  const int threads =
      options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EncoderPool pool(tokenizer, threads, options.input, field, eod.id);
  const size_t max_in_flight = 2 * static_cast<size_t>(threads) + 1;
  std::deque<std::shared_ptr<Block>> in_flight;
  int64_t line_no = 0;
  bool eof = false;
  auto last_report = start;
  const auto seconds_since_start = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const auto report = [&](bool final) {
    if (!options.progress) return;
    options.progress(
        PrepareProgress{summary.documents, summary.tokens, summary.input_bytes, seconds_since_start(), final});
  };
  for (;;) {
    while (!eof && in_flight.size() < max_in_flight) {
      auto block = std::make_shared<Block>();
      block->first_line = line_no + 1;
      std::string line;
      while (block->lines.size() < kBlockLines && static_cast<size_t>(block->bytes) < kBlockBytes &&
             std::getline(in, line)) {
        ++line_no;
        block->bytes += static_cast<int64_t>(line.size()) + 1;
        block->lines.push_back(std::move(line));
      }
      MT_CHECK(!in.bad(), "data prepare: reading {} failed at line {}", options.input, line_no + 1);
      if (block->lines.empty()) {
        eof = true;
        break;
      }
      in_flight.push_back(block);
      pool.submit(std::move(block));
    }
    if (in_flight.empty()) break;
    const std::shared_ptr<Block> block = std::move(in_flight.front());
    in_flight.pop_front();
    pool.wait(*block);
    if (block->error) std::rethrow_exception(block->error);
    size_t offset = 0;
    for (int64_t size : block->sizes) {
      const std::span<const int32_t> doc(block->ids.data() + offset, static_cast<size_t>(size));
      for (int32_t id : doc) summary.max_id = std::max<int64_t>(summary.max_id, id);
      builder.add_sequence(doc);
      offset += static_cast<size_t>(size);
      summary.documents += 1;
      summary.tokens += size;
    }
    summary.skipped_empty += block->skipped;
    summary.input_bytes += block->bytes;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_report >= std::chrono::milliseconds(500)) {
      last_report = now;
      report(false);
    }
  }
  MT_CHECK(summary.documents > 0, "data prepare: empty input: {} holds no documents{} (expected at least one)",
           options.input,
           summary.skipped_empty > 0 ? fmt::format(" ({} empty ones skipped)", summary.skipped_empty) : "");
  builder.finish();
  folder.release();
  summary.seconds = seconds_since_start();
  report(true);
  summary.idx_path = options.output + ".idx";
  summary.bin_path = options.output + ".bin";
  return summary;
}

}  // namespace moetrain::train::data
