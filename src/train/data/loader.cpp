// defines: DataLoader: the blended, per-epoch shuffled document stream, the packed and fixed
// packers, data-parallel sharding by skipping, and the state round trip; cut_documents_at_rows.
#include "train/data/loader.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace moetrain::train::data {

namespace {

constexpr const char* kStateFormat = "moetrain.data_loader";
constexpr int64_t kStateVersion = 1;

const nlohmann::json& require_key(const nlohmann::json& object, const std::string& key, const std::string& where) {
  const auto it = object.find(key);
  MT_CHECK(it != object.end(), "data loader state: missing key \"{}{}\"", where, key);
  return *it;
}

int64_t require_int(const nlohmann::json& object, const std::string& key, const std::string& where, int64_t lo,
                    int64_t hi) {
  const nlohmann::json& value = require_key(object, key, where);
  MT_CHECK(value.is_number_integer(), "data loader state: key \"{}{}\" is {} {} (expected an integer)", where, key,
           value.type_name(), value.dump());
  MT_CHECK(!value.is_number_unsigned() || value.get<uint64_t>() <= static_cast<uint64_t>(hi),
           "data loader state: key \"{}{}\" is {} (expected an integer in [{}, {}])", where, key, value.dump(), lo, hi);
  const auto v = value.get<int64_t>();
  MT_CHECK(v >= lo && v <= hi, "data loader state: key \"{}{}\" is {} (expected an integer in [{}, {}])", where, key, v,
           lo, hi);
  return v;
}

}  // namespace

std::vector<int32_t> cut_documents_at_rows(const std::vector<int32_t>& cu_seqlens, int64_t row_tokens) {
  MT_CHECK(row_tokens > 0, "cut_documents_at_rows: row_tokens is {} (expected > 0)", row_tokens);
  MT_CHECK(!cu_seqlens.empty() && cu_seqlens.front() == 0,
           "cut_documents_at_rows: cu_seqlens {} (expected document boundaries starting at 0)",
           cu_seqlens.empty() ? std::string("is empty") : fmt::format("starts at {}", cu_seqlens.front()));
  std::vector<int32_t> cut;
  cut.reserve(cu_seqlens.size() + static_cast<size_t>(cu_seqlens.back() / row_tokens));
  int64_t row_end = row_tokens;  // the next row boundary not yet in `cut`
  for (size_t i = 0; i < cu_seqlens.size(); ++i) {
    const int32_t boundary = cu_seqlens[i];
    MT_CHECK(i == 0 || boundary > cu_seqlens[i - 1],
             "cut_documents_at_rows: cu_seqlens[{}] = {} is not greater than cu_seqlens[{}] = {} (expected strictly "
             "increasing)",
             i, boundary, i - 1, cu_seqlens[i - 1]);
    for (; row_end < boundary; row_end += row_tokens) cut.push_back(static_cast<int32_t>(row_end));
    if (row_end == boundary) row_end += row_tokens;
    cut.push_back(boundary);
  }
  return cut;
}

DataLoader::DataLoader(const LoaderOptions& options) : options_(options) {
  MT_CHECK(options.mode == "packed" || options.mode == "fixed" || options.mode == "synthetic",
           "data loader: unknown mode \"{}\" (expected \"packed\", \"fixed\" or \"synthetic\")", options.mode);
  packed_ = options.mode == "packed";
  synthetic_ = options.mode == "synthetic";
  MT_CHECK(synthetic_ || !options.sources.empty(),
           "data loader: no data sources (expected at least one [[data.sources]] or data.path)");
  MT_CHECK(!synthetic_ || options.sources.empty(),
           "data loader: mode \"synthetic\" reads no data but {} source(s) are given", options.sources.size());
  MT_CHECK(options.seq_len > 0, "data loader: seq_len is {} (expected > 0)", options.seq_len);
  MT_CHECK(options.micro_batch > 0, "data loader: micro_batch is {} (expected > 0)", options.micro_batch);
  MT_CHECK(options.micro_batch <= std::numeric_limits<int32_t>::max() / options.seq_len,
           "data loader: micro_batch * seq_len = {} * {} exceeds the 32-bit token offsets of cu_seqlens",
           options.micro_batch, options.seq_len);
  MT_CHECK(options.vocab_size > 0, "data loader: vocab_size is {} (expected > 0)", options.vocab_size);
  MT_CHECK(options.world >= 1 && options.rank >= 0 && options.rank < options.world,
           "data loader: rank {} of world {} (expected world >= 1 and 0 <= rank < world)", options.rank, options.world);

  double total_weight = 0;
  for (size_t s = 0; s < options.sources.size(); ++s) {
    const io::DataSource& source = options.sources[s];
    MT_CHECK(std::isfinite(source.weight) && source.weight > 0,
             "data loader: source {} ({}) has weight {} (expected a positive weight)", s, source.path, source.weight);
    total_weight += source.weight;
  }
  for (size_t s = 0; s < options.sources.size(); ++s) {
    Source source(IndexedDataset::open(options.sources[s].path));
    source.weight = options.sources[s].weight / total_weight;
    const IndexedDataset& ds = source.dataset;
    MT_CHECK(ds.dtype() != IndexDType::Float32 && ds.dtype() != IndexDType::Float64,
             "data loader: {} stores {} values, not token ids (expected an integer dtype)", ds.bin_path(),
             index_dtype_name(ds.dtype()));
    // A source that can never contribute a token would make the packer loop for ever.
    bool usable = false;
    for (int64_t i = 0; i < ds.num_sequences() && !usable; ++i) usable = ds.sequence_length(i) >= (packed_ ? 2 : 1);
    MT_CHECK(usable, "data loader: {} has no document of {} (expected at least one; it holds {} sequences)",
             ds.idx_path(), packed_ ? "2 or more tokens, which packed mode needs" : "1 or more tokens",
             ds.num_sequences());
    sources_.push_back(std::move(source));
  }
}

DataLoader::Cursor DataLoader::draw_document() {
  // Megatron's blending: at draw i take the source furthest behind its share, weight * (i + 1) -
  // drawn, ties to the lower index.
  int64_t draws = 0;
  for (const Source& source : sources_) draws += source.drawn;
  int best = 0;
  double best_error = 0;
  for (size_t s = 0; s < sources_.size(); ++s) {
    const double error = sources_[s].weight * static_cast<double>(draws + 1) - static_cast<double>(sources_[s].drawn);
    if (s == 0 || error > best_error) {
      best = static_cast<int>(s);
      best_error = error;
    }
  }
  Source& source = sources_[static_cast<size_t>(best)];
  const int64_t n = source.dataset.num_sequences();
  if (source.position == n) {  // exhausted: the next epoch
    ++source.epoch;
    source.position = 0;
  }
  int64_t sequence = source.position;
  if (options_.shuffle) {
    if (source.order_epoch != source.epoch) {
      source.order.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) source.order[static_cast<size_t>(i)] = i;
      Rng rng = Rng::for_key(options_.seed, fmt::format("{}/epoch {}", best, source.epoch));
      for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates
        const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
        std::swap(source.order[static_cast<size_t>(i)], source.order[static_cast<size_t>(j)]);
      }
      source.order_epoch = source.epoch;
    }
    sequence = source.order[static_cast<size_t>(source.position)];
  }
  ++source.position;
  ++source.drawn;
  return Cursor{best, sequence, 0, source.dataset.sequence_length(sequence)};
}

void DataLoader::read_checked(const Cursor& cursor, int64_t count, int32_t* out) const {
  const IndexedDataset& ds = sources_[static_cast<size_t>(cursor.source)].dataset;
  ds.read(cursor.sequence, cursor.offset, count, out);
  for (int64_t k = 0; k < count; ++k) {
    MT_CHECK(out[k] >= 0 && out[k] < options_.vocab_size,
             "data loader: {}: sequence {} holds token id {} (token {}), outside the model's vocabulary [0, {})",
             ds.bin_path(), cursor.sequence, out[k], cursor.offset + k, options_.vocab_size);
  }
}

void DataLoader::pack(bool materialize, std::vector<int32_t>& inputs, std::vector<int32_t>& targets,
                      std::vector<int32_t>& cu_seqlens) {
  const int64_t budget = tokens_per_micro_batch();
  if (materialize) {
    inputs.resize(static_cast<size_t>(budget));
    targets.resize(static_cast<size_t>(budget));
    cu_seqlens.assign(1, 0);
  }
  std::vector<int32_t> buffer;
  if (packed_) {
    int64_t filled = 0;
    while (filled < budget) {
      if (cursor_.source < 0) {
        cursor_ = draw_document();
        if (cursor_.length < 2) {  // a 1-token document has no (input, target) pair
          cursor_ = Cursor{};
          continue;
        }
      }
      const int64_t available = cursor_.length - cursor_.offset - 1;
      const int64_t take = std::min(available, budget - filled);
      if (materialize) {
        buffer.resize(static_cast<size_t>(take + 1));
        read_checked(cursor_, take + 1, buffer.data());
        std::copy(buffer.begin(), buffer.end() - 1, inputs.begin() + filled);
        std::copy(buffer.begin() + 1, buffer.end(), targets.begin() + filled);
      }
      filled += take;
      if (materialize) cu_seqlens.push_back(static_cast<int32_t>(filled));
      if (take < available) {
        cursor_.offset += take;  // the rest starts at the token whose target was the last one taken
      } else {
        cursor_ = Cursor{};
      }
    }
    // Rows are attention windows: a document that runs on into the next row continues there as a new segment.
    if (materialize) cu_seqlens = cut_documents_at_rows(cu_seqlens, options_.seq_len);
    return;
  }
  const int64_t row_tokens = options_.seq_len + 1;
  buffer.resize(static_cast<size_t>(row_tokens));
  for (int64_t row = 0; row < options_.micro_batch; ++row) {
    int64_t got = 0;
    while (got < row_tokens) {
      if (cursor_.source < 0 || cursor_.offset == cursor_.length) {
        cursor_ = draw_document();
        continue;  // an empty document is passed over by the next turn
      }
      const int64_t take = std::min(row_tokens - got, cursor_.length - cursor_.offset);
      if (materialize) read_checked(cursor_, take, buffer.data() + got);
      got += take;
      cursor_.offset += take;
    }
    cursor_.offset -= 1;  // the next row starts at this row's last token
    if (materialize) {
      const auto base = static_cast<size_t>(row * options_.seq_len);
      std::copy(buffer.begin(), buffer.end() - 1, inputs.begin() + static_cast<std::ptrdiff_t>(base));
      std::copy(buffer.begin() + 1, buffer.end(), targets.begin() + static_cast<std::ptrdiff_t>(base));
    }
  }
}

void DataLoader::synthesize(std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const {
  const int64_t rows = options_.micro_batch, seq = options_.seq_len;
  // Micro-batch m draws rows * (seq + 1) ids from counter m * rows * (seq + 1): a function of m alone.
  const Rng base = Rng::for_key(options_.seed, "synthetic");
  Rng rng(base.seed(), base.counter() + static_cast<uint64_t>(micro_batches_ * rows * (seq + 1)));
  const auto vocab = static_cast<uint64_t>(options_.vocab_size);
  for (int64_t row = 0; row < rows; ++row) {
    int32_t previous = static_cast<int32_t>(rng.below(vocab));
    for (int64_t t = 0; t < seq; ++t) {
      const auto id = static_cast<int32_t>(rng.below(vocab));
      inputs.push_back(previous);
      targets.push_back(id);
      previous = id;
    }
  }
}

model::MicroBatch DataLoader::next() {
  std::vector<int32_t> inputs, targets, cu_seqlens;
  // Every rank walks the same global sequence over a group of `world` micro-batches and keeps its
  // own; the state after the call is the same on every rank.
  for (int r = 0; r < options_.world; ++r) {
    if (synthetic_) {
      if (r == options_.rank) synthesize(inputs, targets);
    } else {
      pack(r == options_.rank, inputs, targets, cu_seqlens);
    }
    ++micro_batches_;
  }
  const int64_t budget = tokens_per_micro_batch();
  if (packed_) {
    const auto documents = static_cast<int64_t>(cu_seqlens.size());
    return model::MicroBatch::packed(Tensor::from_vector(inputs, {budget}), Tensor::from_vector(targets, {budget}),
                                     Tensor::from_vector(cu_seqlens, {documents}));
  }
  const Shape rows{options_.micro_batch, options_.seq_len};
  return model::MicroBatch::from_rows(Tensor::from_vector(inputs, rows), Tensor::from_vector(targets, rows));
}

nlohmann::json DataLoader::state() const {
  nlohmann::json sources = nlohmann::json::array();
  for (const Source& source : sources_) {
    sources.push_back({{"path", source.dataset.path()},
                       {"sequences", source.dataset.num_sequences()},
                       {"epoch", source.epoch},
                       {"position", source.position},
                       {"drawn", source.drawn}});
  }
  nlohmann::json pending = nullptr;
  if (cursor_.source >= 0) {
    pending = {{"source", cursor_.source}, {"sequence", cursor_.sequence}, {"offset", cursor_.offset}};
  }
  return {{"format", kStateFormat},        {"version", kStateVersion},     {"mode", options_.mode},
          {"shuffle", options_.shuffle},   {"seed", options_.seed},        {"micro_batches", micro_batches_},
          {"sources", std::move(sources)}, {"pending", std::move(pending)}};
}

void DataLoader::restore(const nlohmann::json& state) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  MT_CHECK(state.is_object(), "data loader state: expected a JSON object but found {}", state.type_name());
  const nlohmann::json& format = require_key(state, "format", "");
  MT_CHECK(format == kStateFormat, "data loader state: key \"format\" is {} (expected \"{}\")", format.dump(),
           kStateFormat);
  require_int(state, "version", "", kStateVersion, kStateVersion);
  const nlohmann::json& mode = require_key(state, "mode", "");
  MT_CHECK(mode == options_.mode,
           "data loader state: key \"mode\" is {} but this loader runs \"{}\" (a state resumes "
           "only the mode it came from)",
           mode.dump(), options_.mode);
  const nlohmann::json& shuffle = require_key(state, "shuffle", "");
  MT_CHECK(shuffle == options_.shuffle, "data loader state: key \"shuffle\" is {} but this loader has shuffle = {}",
           shuffle.dump(), options_.shuffle);
  const nlohmann::json& seed = require_key(state, "seed", "");
  MT_CHECK(seed.is_number_unsigned() && seed.get<uint64_t>() == options_.seed,
           "data loader state: key \"seed\" is {} but this loader has seed {} (positions belong to that seed's "
           "permutations)",
           seed.dump(), options_.seed);
  const int64_t micro_batches = require_int(state, "micro_batches", "", 0, kMax);

  const nlohmann::json& sources = require_key(state, "sources", "");
  MT_CHECK(
      sources.is_array() && sources.size() == sources_.size(),
      "data loader state: key \"sources\" is {} (expected an array of {} entries, one per source)",
      sources.is_array() ? fmt::format("an array of {} entries", sources.size()) : std::string(sources.type_name()),
      sources_.size());
  std::vector<std::array<int64_t, 3>> counters;  // epoch, position, drawn
  for (size_t s = 0; s < sources_.size(); ++s) {
    const std::string where = fmt::format("sources[{}].", s);
    const nlohmann::json& entry = sources[s];
    MT_CHECK(entry.is_object(), "data loader state: key \"sources[{}]\" is {} (expected an object)", s,
             entry.type_name());
    const int64_t n = sources_[s].dataset.num_sequences();
    require_int(entry, "sequences", where, n, n);  // the same dataset: same sequence count
    counters.push_back({require_int(entry, "epoch", where, 0, kMax), require_int(entry, "position", where, 0, n),
                        require_int(entry, "drawn", where, 0, kMax)});
  }

  Cursor cursor;
  const nlohmann::json& pending = require_key(state, "pending", "");
  if (!pending.is_null()) {
    MT_CHECK(pending.is_object(), "data loader state: key \"pending\" is {} (expected null or an object)",
             pending.type_name());
    cursor.source = static_cast<int>(require_int(pending, "source", "pending.", 0, int64_t(sources_.size()) - 1));
    const IndexedDataset& ds = sources_[static_cast<size_t>(cursor.source)].dataset;
    cursor.sequence = require_int(pending, "sequence", "pending.", 0, ds.num_sequences() - 1);
    cursor.length = ds.sequence_length(cursor.sequence);
    // packed: at least one (input, target) pair is left; fixed: the offset is a token of the document.
    cursor.offset = require_int(pending, "offset", "pending.", 0, cursor.length - (packed_ ? 2 : 1));
  }

  // Everything is valid: apply.
  for (size_t s = 0; s < sources_.size(); ++s) {
    sources_[s].epoch = counters[s][0];
    sources_[s].position = counters[s][1];
    sources_[s].drawn = counters[s][2];
  }
  cursor_ = cursor;
  micro_batches_ = micro_batches;
}

}  // namespace moetrain::train::data
