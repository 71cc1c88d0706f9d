// defines: DataLoader, the training job's stream of micro-batches: documents drawn from weighted
// indexed datasets (Megatron's blending rule, a seeded permutation per epoch), cut into packed
// micro-batches of whole or split documents or into fixed rows, sharded over data-parallel ranks,
// with a JSON state that lets a resumed job continue with identical micro-batches; and
// cut_documents_at_rows, the rule that no document crosses a row, shared with `moetrain score`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/job_config.h"
#include "model/batch.h"
#include "train/data/indexed_dataset.h"

namespace moetrain::train::data {

struct LoaderOptions {
  std::vector<io::DataSource> sources;  // indexed dataset prefixes and mixture weights (> 0)
  std::string mode = "packed";          // "packed" | "fixed" | "synthetic" (see io::DataSection)
  bool shuffle = true;                  // documents in a seeded permutation per epoch, else in order
  int64_t seq_len = 0;                  // tokens per row
  int64_t micro_batch = 1;              // rows per micro-batch
  uint64_t seed = 0;
  int64_t vocab_size = 0;  // every id read must lie in [0, vocab_size)
  int rank = 0;            // data-parallel rank and world size
  int world = 1;
};

// The one rule of a micro-batch of rows of `row_tokens` tokens, in training (the packed loader
// applies it) and in `moetrain score` (whose input must already follow it): every row is its own
// attention window, so a document never crosses rows. Returns `cu_seqlens` (document boundaries:
// starting at 0, strictly increasing) with every row boundary r * row_tokens below its last entry
// added: a document that crosses one becomes two segments there. No segment of the result is
// longer than row_tokens, the max length the exact lanes declare (exact::check_varlen_metadata).
std::vector<int32_t> cut_documents_at_rows(const std::vector<int32_t>& cu_seqlens, int64_t row_tokens);

// The global sequence of micro-batches depends only on the data and the options other than
// rank / world; rank r of world n returns global micro-batches r, r + n, r + 2n, ... (it runs the
// same packer and skips the others' micro-batches, reading no tokens for them).
//
// packed: each micro-batch holds exactly micro_batch * seq_len (input, target) pairs. A document
// of L tokens gives inputs d[0..L-2] and targets d[1..L-1]; documents fill the budget whole, and
// the one that does not fit is split: its first part fills the micro-batch, the rest starts the
// next micro-batch at the token whose target was the last one taken. The micro-batch is
// micro_batch rows of seq_len tokens, each row its own attention window: cu_seqlens holds every
// document and every row boundary (cut_documents_at_rows), so a document that runs on into the
// next row continues there as a new segment (positions restart, no target is lost) and no
// segment is longer than seq_len. Documents of fewer than 2 tokens give nothing and are skipped.
// fixed: the documents' tokens form one stream; each row takes seq_len + 1 consecutive tokens
// (inputs the first seq_len, targets the last seq_len) and the next row starts at this row's last
// token. Rows are the micro-batch's documents (MicroBatch::from_rows).
class DataLoader {
 public:
  // Opens every source (missing files are errors naming them) and checks the options.
  explicit DataLoader(const LoaderOptions& options);

  model::MicroBatch next();
  int64_t tokens_per_micro_batch() const { return options_.micro_batch * options_.seq_len; }

  // Everything needed to continue exactly: per-source epoch, position and draw count, the pending
  // document part, the global micro-batch counter. After the same number of next() calls the
  // state is the same on every rank, so one rank's state resumes all (even with another world).
  nlohmann::json state() const;
  // Continues from `state` (from a loader with the same sources, mode, shuffle and seed). The
  // JSON is validated completely (missing keys, wrong types or sizes, out-of-range positions:
  // errors naming the key) before anything changes.
  void restore(const nlohmann::json& state);

 private:
  struct Source {
    explicit Source(IndexedDataset opened) : dataset(std::move(opened)) {}
    IndexedDataset dataset;
    double weight = 0;           // normalised
    int64_t epoch = 0;           // current epoch
    int64_t position = 0;        // documents of this epoch already drawn, in [0, num_sequences]
    int64_t drawn = 0;           // documents drawn from this source in total (blending)
    std::vector<int64_t> order;  // permutation of this epoch (shuffle only)
    int64_t order_epoch = -1;    // the epoch `order` belongs to
  };
  // A document being consumed: packed mode's pending split part (inputs start at `offset`), or
  // fixed mode's stream position (the next row starts at token `offset`). source < 0: none.
  struct Cursor {
    int source = -1;
    int64_t sequence = 0;
    int64_t offset = 0;
    int64_t length = 0;
  };

  Cursor draw_document();
  // Builds the global micro-batch at the packer's position; with materialize false it only
  // advances (no tokens are read).
  // synthetic: rows of uniformly random ids, each target the next id (benchmarks).
  void synthesize(std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const;
  void pack(bool materialize, std::vector<int32_t>& inputs, std::vector<int32_t>& targets,
            std::vector<int32_t>& cu_seqlens);
  void read_checked(const Cursor& cursor, int64_t count, int32_t* out) const;

  LoaderOptions options_;
  bool packed_ = true;
  bool synthetic_ = false;
  std::vector<Source> sources_;
  Cursor cursor_;
  int64_t micro_batches_ = 0;  // global micro-batches the packer has passed
};

}  // namespace moetrain::train::data
