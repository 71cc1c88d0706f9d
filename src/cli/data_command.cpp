// defines: the `data` command group of the `moetrain` program (one subcommand so far: prepare).
#include "cli/data_command.h"

#include <cstdio>
#include <memory>

#include <fmt/format.h>

namespace moetrain::cli {

int run_data_prepare(const DataPrepareOptions& options) {
  const train::data::PrepareSummary summary = train::data::prepare_dataset(options);
  fmt::print("data prepare: {} documents, {} tokens (EOD included, largest id {}), stored as {}\n", summary.documents,
             summary.tokens, summary.max_id, train::data::index_dtype_name(summary.dtype));
  if (summary.skipped_empty > 0) fmt::print("data prepare: skipped {} empty documents\n", summary.skipped_empty);
  fmt::print("data prepare: wrote {} and {}\n", summary.idx_path, summary.bin_path);
  std::fflush(stdout);
  return 0;
}

void add_data_command(CLI::App& app, std::function<int()>& command) {
  CLI::App* data = app.add_subcommand("data", "Prepare training data");
  data->require_subcommand(1);
  CLI::App* prepare = data->add_subcommand(
      "prepare",
      "Tokenise JSONL token ids, JSONL text or plain text into a Megatron indexed dataset (PREFIX.idx + "
      "PREFIX.bin)");
  // Owned by the callback below, which the app keeps for as long as it lives.
  auto options = std::make_shared<DataPrepareOptions>();
  auto eod = std::make_shared<int64_t>(0);
  prepare->add_option("--output", options->output, "output prefix: writes PREFIX.idx and PREFIX.bin")->required();
  CLI::Option* input = prepare->add_option("--input", options->input, "JSONL file, one document per line");
  CLI::Option* field = prepare->add_option("--field", options->field, "JSONL field holding an array of token ids")
                           ->capture_default_str();
  CLI::Option* text_field =
      prepare->add_option("--text-field", options->text_field, "JSONL field holding text (byte-tokenised)");
  CLI::Option* text = prepare->add_option("--text", options->text_files,
                                          "plain-text files; each paragraph (lines up to a blank line) is a document");
  CLI::Option* eod_option = prepare->add_option("--eod", *eod,
                                                "end-of-document id appended to every document "
                                                "(required with --field; byte mode appends 256)");
  prepare->add_option("--dtype", options->dtype, "stored dtype: auto (uint16 when every id < 65536) | uint16 | int32")
      ->capture_default_str();
  input->excludes(text);
  text_field->needs(input);
  text_field->excludes(field);
  field->needs(input);
  prepare->callback([options, eod, eod_option, &command] {
    if (eod_option->count() > 0) options->eod = *eod;
    command = [options] { return run_data_prepare(*options); };
  });
}

}  // namespace moetrain::cli
