// defines: the `data` command group of the `moetrain` program (one subcommand so far: prepare).
#include "cli/data_command.h"

#include <unistd.h>
#include <cstdio>
#include <memory>

#include <fmt/format.h>

namespace moetrain::cli {

namespace {

// The progress line of a tokenizer run on stderr: rewritten in place on a terminal, one line every ~10 s otherwise.
void print_progress(const train::data::PrepareProgress& p) {
  static const bool terminal = isatty(fileno(stderr)) != 0;
  static double last_line = 0;
  if (!terminal && !p.final && p.seconds - last_line < 10) return;
  last_line = p.seconds;
  const double mb = static_cast<double>(p.input_bytes) / 1e6;
  fmt::print(stderr, "{}data prepare: {} documents, {:.1f} MB, {} tokens, {:.2f} MB/s{}", terminal ? "\r" : "",
             p.documents, mb, p.tokens, p.seconds > 0 ? mb / p.seconds : 0.0, terminal && !p.final ? "" : "\n");
  std::fflush(stderr);
}

}  // namespace

int run_data_prepare(const DataPrepareOptions& options) {
  DataPrepareOptions run = options;
  if (!run.tokenizer.empty() && !run.progress) run.progress = print_progress;
  const train::data::PrepareSummary summary = train::data::prepare_dataset(run);
  if (!summary.tokenizer.empty()) {
    fmt::print("data prepare: tokenizer {}: {}\n", options.tokenizer, summary.tokenizer);
    fmt::print("data prepare: end of document {} ({})\n", summary.eod, summary.eod_source);
    if (!summary.tokenizer_note.empty()) fmt::print("data prepare: note: {}\n", summary.tokenizer_note);
  }
  fmt::print("data prepare: {} documents, {} tokens (EOD included, largest id {}), stored as {}\n", summary.documents,
             summary.tokens, summary.max_id, train::data::index_dtype_name(summary.dtype));
  if (summary.skipped_empty > 0) fmt::print("data prepare: skipped {} empty documents\n", summary.skipped_empty);
  fmt::print("data prepare: wrote {} and {}\n", summary.idx_path, summary.bin_path);
  if (!summary.tokenizer.empty()) {
    fmt::print("data prepare: {:.1f} MB in {:.1f} s ({:.2f} MB/s)\n", static_cast<double>(summary.input_bytes) / 1e6,
               summary.seconds,
               summary.seconds > 0 ? static_cast<double>(summary.input_bytes) / 1e6 / summary.seconds : 0.0);
  }
  std::fflush(stdout);
  return 0;
}

void add_data_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* data = app.add_subcommand("data", "Prepare training data");
  data->require_subcommand(1);
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenise JSONL token ids, JSONL text (bytes, or a Hugging Face tokenizer.json) or plain text into a Megatron "
      "indexed dataset (PREFIX.idx + PREFIX.bin)");
  // Owned by the callback below, which the app keeps for as long as it lives.
  auto options = std::make_shared<DataPrepareOptions>();
  auto eod = std::make_shared<int64_t>(0);
  prepare->add_option("--output", options->output, "output prefix: writes PREFIX.idx and PREFIX.bin")->required();
  CLI::Option* input = prepare->add_option("--input", options->input, "JSONL file, one document per line");
  CLI::Option* field = prepare->add_option("--field", options->field, "JSONL field holding an array of token ids")
                           ->capture_default_str();
  CLI::Option* text_field = prepare->add_option(
      "--text-field", options->text_field, "JSONL field holding text (byte-tokenised, or encoded with --tokenizer)");
  CLI::Option* tokenizer = prepare->add_option(
      "--tokenizer", options->tokenizer,
      "tokenizer.json, or a folder holding one: byte-level BPE (Qwen2/3, DeepSeek-V3, GPT-OSS, GPT-2 styles) for the "
      "text in --text-field (default \"text\")");
  CLI::Option* threads =
      prepare->add_option("--threads", options->threads, "tokenizer worker threads (0: one per hardware thread)");
  CLI::Option* text = prepare->add_option("--text", options->text_files,
                                          "plain-text files; each paragraph (lines up to a blank line) is a document");
  CLI::Option* eod_option = prepare->add_option("--eod", *eod,
                                                "end-of-document id appended to every document "
                                                "(required with --field; byte mode appends 256; with --tokenizer, "
                                                "default <|endoftext|> or tokenizer_config.json's eos_token)");
  prepare->add_option("--dtype", options->dtype, "stored dtype: auto (uint16 when every id < 65536) | uint16 | int32")
      ->capture_default_str();
  input->excludes(text);
  text_field->needs(input);
  text_field->excludes(field);
  field->needs(input);
  tokenizer->needs(input);
  tokenizer->excludes(field);
  threads->needs(tokenizer);
  prepare->callback([options, eod, eod_option, &command] {
    if (eod_option->count() > 0) options->eod = *eod;
    command = [options] { return run_data_prepare(*options); };
  });
}

}  // namespace moetrain::cli
