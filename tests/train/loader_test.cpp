// Tests for train/data/loader: packing invariants (no document crosses a row: the exact lanes' max
// length holds), the row rule shared with score, fixed rows, Megatron blending, per-epoch
// shuffling, data-parallel sharding, state/restore exactness and the loader's error paths.
#include "train/data/loader.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <string_view>
#include <utility>

#include <gtest/gtest.h>

#include "core/error.h"
#include "exact/wire_checks.h"
#include "testing/error_message.h"
#include "testing/test_data.h"
#include "train/data/indexed_dataset.h"

namespace moetrain::train::data {
namespace {

using testing::expect_error;

using Docs = std::vector<std::vector<int32_t>>;

// Documents of the given lengths whose tokens are all distinct: first_id, first_id + 1, ...
Docs distinct_docs(const std::vector<int>& lengths, int32_t first_id = 0) {
  Docs docs;
  int32_t next = first_id;
  for (int length : lengths) {
    std::vector<int32_t> doc;
    for (int k = 0; k < length; ++k) doc.push_back(next++);
    docs.push_back(doc);
  }
  return docs;
}

std::string write_corpus(const Docs& docs, const std::string& tag = "loader") {
  const std::string prefix = testing::make_temp_dir(tag) + "/corpus";
  IndexedDatasetBuilder builder(prefix, IndexDType::Int32);
  for (const auto& doc : docs) builder.add_sequence(doc);
  builder.finish();
  return prefix;
}

LoaderOptions options_for(std::vector<io::DataSource> sources, std::string mode, int64_t seq_len, int64_t micro_batch,
                          bool shuffle = false, uint64_t seed = 7) {
  LoaderOptions o;
  o.sources = std::move(sources);
  o.mode = std::move(mode);
  o.seq_len = seq_len;
  o.micro_batch = micro_batch;
  o.shuffle = shuffle;
  o.seed = seed;
  o.vocab_size = 100000;
  return o;
}

struct Plain {
  std::vector<int32_t> inputs, targets, positions, cu;
  bool operator==(const Plain&) const = default;
};

Plain plain(const model::MicroBatch& mb) {
  return {mb.input_ids.to_vector<int32_t>(), mb.targets.to_vector<int32_t>(), mb.position_ids.to_vector<int32_t>(),
          mb.cu_seqlens.to_vector<int32_t>()};
}

std::vector<Plain> read_n(DataLoader& loader, int n) {
  std::vector<Plain> out;
  for (int i = 0; i < n; ++i) out.push_back(plain(loader.next()));
  return out;
}

// ---- packed mode ----

TEST(DataLoader, PackedMicroBatchesHoldExactlyTheBudgetInSegments) {
  const Docs docs = distinct_docs({5, 1, 13, 2, 9, 30, 3, 4, 1, 7});
  const std::string prefix = write_corpus(docs);
  DataLoader loader(options_for({{prefix, 1.0}}, "packed", 6, 2, /*shuffle=*/true));
  EXPECT_EQ(loader.tokens_per_micro_batch(), 12);
  for (int step = 0; step < 20; ++step) {
    const model::MicroBatch mb = loader.next();
    mb.validate(100000);
    const Plain p = plain(mb);
    ASSERT_EQ(p.inputs.size(), 12u);
    EXPECT_EQ(mb.num_targets(), 12) << "every target is a real next token";
    ASSERT_GE(p.cu.size(), 2u);
    EXPECT_EQ(p.cu.front(), 0);
    EXPECT_EQ(p.cu.back(), 12);
    for (size_t d = 1; d < p.cu.size(); ++d) EXPECT_LT(p.cu[d - 1], p.cu[d]);
  }
}

TEST(DataLoader, PackedTargetsAreTheNextTokensOfTheSameDocument) {
  const Docs docs = distinct_docs({5, 1, 13, 2, 9, 30, 3, 4, 1, 7});
  std::map<int32_t, std::pair<size_t, size_t>> where;  // token -> (document, position)
  for (size_t d = 0; d < docs.size(); ++d) {
    for (size_t k = 0; k < docs[d].size(); ++k) where[docs[d][k]] = {d, k};
  }
  DataLoader loader(options_for({{write_corpus(docs), 1.0}}, "packed", 5, 1, /*shuffle=*/true));
  for (int step = 0; step < 30; ++step) {
    const Plain p = plain(loader.next());
    for (size_t seg = 0; seg + 1 < p.cu.size(); ++seg) {
      const auto [doc, start] = where.at(p.inputs[static_cast<size_t>(p.cu[seg])]);
      for (int32_t t = p.cu[seg]; t < p.cu[seg + 1]; ++t) {
        const size_t k = start + static_cast<size_t>(t - p.cu[seg]);
        ASSERT_LT(k + 1, docs[doc].size()) << "segment runs past its document";
        EXPECT_EQ(p.inputs[static_cast<size_t>(t)], docs[doc][k]);
        EXPECT_EQ(p.targets[static_cast<size_t>(t)], docs[doc][k + 1]);
        EXPECT_EQ(p.positions[static_cast<size_t>(t)], t - p.cu[seg]);
      }
    }
  }
}

TEST(DataLoader, PackedSplitDocumentsContinueWithoutLosingATarget) {
  // Budget 8; a 20-token document spans three micro-batches, 1-token documents give nothing.
  const Docs docs = distinct_docs({3, 20, 1, 6, 2, 1, 11, 4});
  DataLoader loader(options_for({{write_corpus(docs), 1.0}}, "packed", 4, 2));
  std::vector<int32_t> expected_inputs, expected_targets;
  for (const auto& doc : docs) {
    for (size_t k = 0; k + 1 < doc.size(); ++k) {
      expected_inputs.push_back(doc[k]);
      expected_targets.push_back(doc[k + 1]);
    }
  }
  const int64_t pairs = static_cast<int64_t>(expected_inputs.size());  // 40
  std::vector<int32_t> inputs, targets;
  std::vector<Plain> batches;
  while (static_cast<int64_t>(inputs.size()) < pairs) {
    batches.push_back(plain(loader.next()));
    inputs.insert(inputs.end(), batches.back().inputs.begin(), batches.back().inputs.end());
    targets.insert(targets.end(), batches.back().targets.begin(), batches.back().targets.end());
  }
  inputs.resize(static_cast<size_t>(pairs));
  targets.resize(static_cast<size_t>(pairs));
  EXPECT_EQ(inputs, expected_inputs) << "the first epoch, in order, is every document's inputs exactly once";
  EXPECT_EQ(targets, expected_targets);
  // The 20-token document (ids 3..22, 19 pairs) is split 6 | 8 | 5 over micro-batches: each later
  // part starts its micro-batch at the token whose target ended the one before. Within a
  // micro-batch it is cut again at each row boundary (rows of 4): 2 + 4 | 4 + 4 | 4 + 1.
  EXPECT_EQ(batches[0].cu, (std::vector<int32_t>{0, 2, 4, 8}));
  EXPECT_EQ(batches[0].targets.back(), 9);
  EXPECT_EQ(batches[1].inputs.front(), 9);
  EXPECT_EQ(batches[1].cu, (std::vector<int32_t>{0, 4, 8}));
  EXPECT_EQ(batches[1].targets.back(), 17);
  EXPECT_EQ(batches[2].inputs.front(), 17);
  EXPECT_EQ(batches[2].cu, (std::vector<int32_t>{0, 4, 5, 8}));
}

TEST(DataLoader, PackedDocumentsNeverCrossARowSoNoSpanExceedsSeqLen) {
  // Documents shorter than a row, longer than a row and longer than a micro-batch (rows of 6, 3 per
  // micro-batch), shuffled over several epochs.
  const Docs docs = distinct_docs({5, 1, 13, 2, 9, 30, 3, 4, 1, 7, 41, 6, 7});
  const int64_t seq_len = 6, rows = 3;
  DataLoader loader(options_for({{write_corpus(docs), 1.0}}, "packed", seq_len, rows, /*shuffle=*/true));
  int64_t crossing_documents = 0;  // segments that continue their document into the next row
  for (int step = 0; step < 40; ++step) {
    const model::MicroBatch mb = loader.next();
    mb.validate(100000);
    const Plain p = plain(mb);
    for (int64_t r = 0; r <= rows; ++r) {
      EXPECT_NE(std::find(p.cu.begin(), p.cu.end(), static_cast<int32_t>(r * seq_len)), p.cu.end())
          << "micro-batch " << step << ": row boundary " << r * seq_len << " is not a segment boundary";
    }
    for (size_t d = 0; d + 1 < p.cu.size(); ++d) {
      EXPECT_EQ(p.cu[d] / seq_len, (p.cu[d + 1] - 1) / seq_len)
          << "micro-batch " << step << ": segment " << d << " [" << p.cu[d] << ", " << p.cu[d + 1] << ") crosses a row";
      // A segment ending at a row boundary whose last target is the next segment's first input continues its
      // document there (the tokens are distinct, so this identifies a cut document).
      if (d + 2 < p.cu.size() && p.cu[d + 1] % seq_len == 0 &&
          p.targets[static_cast<size_t>(p.cu[d + 1] - 1)] == p.inputs[static_cast<size_t>(p.cu[d + 1])])
        ++crossing_documents;
    }
    EXPECT_LE(mb.max_document_length(), seq_len) << "micro-batch " << step;
    EXPECT_EQ(cut_documents_at_rows(p.cu, seq_len), p.cu) << "micro-batch " << step << " breaks the row rule";
    // The exact lanes' varlen metadata with the declared max length seq_len, as exact-mode training checks it.
    EXPECT_NO_THROW(exact::check_varlen_metadata(mb, seq_len, step)) << "micro-batch " << step;
  }
  EXPECT_GT(crossing_documents, 0) << "the corpus should make documents run on into the next row";
}

TEST(DataLoader, CutDocumentsAtRowsSplitsOnlyTheDocumentsThatCrossARow) {
  using Cu = std::vector<int32_t>;
  EXPECT_EQ(cut_documents_at_rows({0, 4, 8}, 4), (Cu{0, 4, 8})) << "one document per row: nothing to cut";
  EXPECT_EQ(cut_documents_at_rows({0, 1, 3, 4, 8}, 4), (Cu{0, 1, 3, 4, 8})) << "documents inside rows stay whole";
  EXPECT_EQ(cut_documents_at_rows({0, 2, 8}, 4), (Cu{0, 2, 4, 8}));
  EXPECT_EQ(cut_documents_at_rows({0, 3, 12}, 4), (Cu{0, 3, 4, 8, 12})) << "a document over three rows";
  EXPECT_EQ(cut_documents_at_rows({0, 12}, 4), (Cu{0, 4, 8, 12}));
  EXPECT_EQ(cut_documents_at_rows({0, 5, 6}, 4), (Cu{0, 4, 5, 6})) << "only boundaries below the last entry";
  EXPECT_EQ(cut_documents_at_rows({0, 7}, 100), (Cu{0, 7}));
  expect_error([] { cut_documents_at_rows({0, 4}, 0); }, {"row_tokens is 0", "> 0"});
  expect_error([] { cut_documents_at_rows({}, 4); }, {"cu_seqlens is empty"});
  expect_error([] { cut_documents_at_rows({1, 4}, 4); }, {"starts at 1", "starting at 0"});
  expect_error([] { cut_documents_at_rows({0, 4, 4, 8}, 4); }, {"cu_seqlens[2] = 4", "cu_seqlens[1] = 4", "strictly"});
}

TEST(DataLoader, RejectsASourceWithNoDocumentToPack) {
  const std::string prefix = write_corpus({{5}, {6}});
  expect_error(
      [&] {
        DataLoader(options_for({{prefix, 1.0}}, "packed", 4, 1));
      },
      {prefix + ".idx", "no document of 2 or more tokens"});
}

// ---- fixed mode ----

TEST(DataLoader, FixedRowsAreConsecutiveWindowsOverlappingByOneToken) {
  const Docs docs = distinct_docs({4, 1, 9, 3});  // a stream of 17 tokens, repeated every epoch
  std::vector<int32_t> stream;
  for (int epoch = 0; epoch < 4; ++epoch) {
    for (const auto& doc : docs) stream.insert(stream.end(), doc.begin(), doc.end());
  }
  const int64_t seq_len = 5, rows = 3;
  DataLoader loader(options_for({{write_corpus(docs), 1.0}}, "fixed", seq_len, rows));
  EXPECT_EQ(loader.tokens_per_micro_batch(), 15);
  int64_t row = 0;
  for (int step = 0; step < 4; ++step) {
    const model::MicroBatch mb = loader.next();
    mb.validate(100000);
    const Plain p = plain(mb);
    EXPECT_EQ(p.cu, (std::vector<int32_t>{0, 5, 10, 15}));
    for (int64_t r = 0; r < rows; ++r, ++row) {
      for (int64_t t = 0; t < seq_len; ++t) {
        const auto i = static_cast<size_t>(r * seq_len + t);
        EXPECT_EQ(p.inputs[i], stream[static_cast<size_t>(row * seq_len + t)]) << "row " << row << " token " << t;
        EXPECT_EQ(p.targets[i], stream[static_cast<size_t>(row * seq_len + t + 1)]) << "row " << row;
        EXPECT_EQ(p.positions[i], t);
      }
    }
  }
}

// ---- blending and shuffling ----

TEST(DataLoader, BlendsSourcesByWeightWithMegatronsRule) {
  // 2-token documents and a 1-token budget: one draw per micro-batch.
  const std::string a = write_corpus(distinct_docs(std::vector<int>(7, 2), 0), "blend_a");
  const std::string b = write_corpus(distinct_docs(std::vector<int>(5, 2), 1000), "blend_b");
  DataLoader loader(options_for({{a, 3.0}, {b, 1.0}}, "packed", 1, 1, /*shuffle=*/true));
  std::string pattern;
  int from_a = 0;
  for (int i = 0; i < 400; ++i) {
    const bool is_a = loader.next().input_ids.to_vector<int32_t>()[0] < 1000;
    from_a += is_a;
    if (i < 8) pattern += is_a ? 'A' : 'B';
    EXPECT_LE(std::abs(from_a - 0.75 * (i + 1)), 1.0) << "draw " << i << " strays from the 3:1 share";
  }
  EXPECT_EQ(from_a, 300);
  EXPECT_EQ(pattern, "AABAAABA");  // ties (draws 1, 5) go to the lower source index
  const nlohmann::json state = loader.state();
  EXPECT_EQ(state["sources"][0]["drawn"], 300);
  EXPECT_EQ(state["sources"][1]["drawn"], 100);
}

// The documents (first tokens) drawn by `n` micro-batches of a 1-token budget.
std::vector<int32_t> first_tokens(DataLoader& loader, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next().input_ids.to_vector<int32_t>()[0]);
  return out;
}

TEST(DataLoader, ShuffleIsAPermutationPerEpochDeterministicFromTheSeed) {
  const std::string prefix = write_corpus(distinct_docs(std::vector<int>(16, 2)));
  auto order = [&](bool shuffle, uint64_t seed) {
    DataLoader loader(options_for({{prefix, 1.0}}, "packed", 1, 1, shuffle, seed));
    return first_tokens(loader, 48);  // three epochs
  };
  const std::vector<int32_t> seed7 = order(true, 7);
  EXPECT_EQ(seed7, order(true, 7));
  EXPECT_NE(seed7, order(true, 8));
  std::vector<int32_t> in_order;
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (int32_t d = 0; d < 16; ++d) in_order.push_back(2 * d);
  }
  EXPECT_EQ(order(false, 7), in_order);
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::vector<int32_t> e(seed7.begin() + epoch * 16, seed7.begin() + (epoch + 1) * 16);
    EXPECT_NE(e, std::vector<int32_t>(in_order.begin(), in_order.begin() + 16)) << "epoch " << epoch;
    std::sort(e.begin(), e.end());
    EXPECT_EQ(e, std::vector<int32_t>(in_order.begin(), in_order.begin() + 16)) << "epoch " << epoch;
  }
  EXPECT_NE(std::vector<int32_t>(seed7.begin(), seed7.begin() + 16),
            std::vector<int32_t>(seed7.begin() + 16, seed7.begin() + 32))
      << "each epoch has its own permutation";
}

// ---- sharding ----

LoaderOptions two_source_options(const std::string& mode, bool shuffle = true) {
  const std::string a = write_corpus(distinct_docs({5, 1, 13, 2, 9, 30, 3, 4, 1, 7}, 0), "shard_a");
  const std::string b = write_corpus(distinct_docs({8, 3, 17, 6, 2}, 5000), "shard_b");
  return options_for({{a, 2.0}, {b, 1.0}}, mode, 4, 3, shuffle, 99);
}

TEST(DataLoader, RanksSplitTheSameGlobalSequence) {
  for (const std::string mode : {"packed", "fixed"}) {
    const LoaderOptions base = two_source_options(mode);
    DataLoader single(base);
    const std::vector<Plain> global = read_n(single, 12);
    std::vector<nlohmann::json> states;
    for (int rank = 0; rank < 4; ++rank) {
      LoaderOptions o = base;
      o.rank = rank;
      o.world = 4;
      DataLoader loader(o);
      const std::vector<Plain> mine = read_n(loader, 3);
      for (int k = 0; k < 3; ++k)
        EXPECT_EQ(mine[static_cast<size_t>(k)], global[static_cast<size_t>(rank + 4 * k)])
            << mode << ": rank " << rank << " micro-batch " << k;
      states.push_back(loader.state());
    }
    for (int rank = 1; rank < 4; ++rank) EXPECT_EQ(states[static_cast<size_t>(rank)], states[0]) << mode;
    EXPECT_EQ(states[0]["micro_batches"], 12);
  }
}

TEST(DataLoader, StateFromOneWorldSizeResumesAnother) {
  const LoaderOptions base = two_source_options("packed");
  DataLoader single(base);
  const std::vector<Plain> global = read_n(single, 10);
  DataLoader first(base);
  read_n(first, 4);
  LoaderOptions o = base;
  o.rank = 1;
  o.world = 2;
  DataLoader resumed(o);
  resumed.restore(first.state());
  const std::vector<Plain> mine = read_n(resumed, 3);
  for (int k = 0; k < 3; ++k) EXPECT_EQ(mine[static_cast<size_t>(k)], global[static_cast<size_t>(5 + 2 * k)]);
}

// ---- state / restore ----

TEST(DataLoader, RestoreContinuesWithIdenticalMicroBatches) {
  for (const std::string mode : {"packed", "fixed"}) {
    for (const bool shuffle : {true, false}) {
      const LoaderOptions o = two_source_options(mode, shuffle);
      DataLoader loader(o);
      read_n(loader, 7);
      const std::string saved = loader.state().dump();  // through text, as a checkpoint keeps it
      const std::vector<Plain> expected = read_n(loader, 5);
      DataLoader fresh(o);
      fresh.restore(nlohmann::json::parse(saved));
      EXPECT_EQ(read_n(fresh, 5), expected) << mode << (shuffle ? " shuffled" : " in order");
    }
  }
}

TEST(DataLoader, RestoreRejectsABadStateAndChangesNothing) {
  const LoaderOptions o = two_source_options("packed");
  DataLoader loader(o), twin(o);
  read_n(loader, 3);
  read_n(twin, 3);
  DataLoader other(o);
  read_n(other, 9);
  const nlohmann::json good = other.state();
  ASSERT_FALSE(good["pending"].is_null()) << "the test wants a pending split part";

  auto expect_rejected = [&](const std::function<void(nlohmann::json&)>& corrupt,
                             std::initializer_list<std::string_view> words) {
    nlohmann::json bad = good;
    corrupt(bad);
    expect_error([&] { loader.restore(bad); }, words);
  };
  expect_rejected([](nlohmann::json& s) { s.erase("pending"); }, {"missing key \"pending\""});
  expect_rejected([](nlohmann::json& s) { s.erase("micro_batches"); }, {"missing key \"micro_batches\""});
  expect_rejected([](nlohmann::json& s) { s["sources"].erase(1); }, {"\"sources\"", "1 entries", "2 entries"});
  expect_rejected([](nlohmann::json& s) { s["sources"][1].erase("epoch"); }, {"missing key \"sources[1].epoch\""});
  expect_rejected([](nlohmann::json& s) { s["sources"][0]["position"] = 11; }, {"\"sources[0].position\"", "11"});
  expect_rejected([](nlohmann::json& s) { s["sources"][0]["sequences"] = 9; }, {"\"sources[0].sequences\"", "9"});
  expect_rejected([](nlohmann::json& s) { s["sources"][0]["drawn"] = "3"; }, {"\"sources[0].drawn\"", "integer"});
  expect_rejected([](nlohmann::json& s) { s["pending"]["source"] = 2; }, {"\"pending.source\"", "[0, 1]"});
  expect_rejected([](nlohmann::json& s) { s["pending"]["offset"] = 1000; }, {"\"pending.offset\"", "1000"});
  expect_rejected([](nlohmann::json& s) { s["mode"] = "fixed"; }, {"\"mode\"", "packed"});
  expect_rejected([](nlohmann::json& s) { s["seed"] = 5; }, {"\"seed\"", "99"});
  expect_rejected([](nlohmann::json& s) { s["format"] = "other"; }, {"\"format\""});
  expect_error([&] { loader.restore(nlohmann::json::array()); }, {"expected a JSON object"});

  EXPECT_EQ(read_n(loader, 4), read_n(twin, 4)) << "a rejected restore changed the loader";
}

// ---- errors ----

TEST(DataLoader, RejectsTokenIdsOutsideTheVocabulary) {
  const std::string prefix = write_corpus({{1, 2, 3}, {4, 300, 5}});
  LoaderOptions o = options_for({{prefix, 1.0}}, "packed", 4, 1);
  o.vocab_size = 257;
  DataLoader loader(o);
  expect_error([&] { loader.next(); }, {prefix + ".bin", "sequence 1", "token id 300", "[0, 257)"});
}

TEST(DataLoader, RejectsMissingDataFiles) {
  const std::string prefix = testing::make_temp_dir("loader_missing") + "/absent";
  expect_error([&] { DataLoader(options_for({{prefix, 1.0}}, "packed", 4, 1)); }, {prefix + ".idx", "does not exist"});
}

TEST(DataLoader, RejectsBadOptions) {
  const std::string prefix = write_corpus({{1, 2, 3}});
  auto expect_rejected = [&](const std::function<void(LoaderOptions&)>& change,
                             std::initializer_list<std::string_view> words) {
    LoaderOptions o = options_for({{prefix, 1.0}}, "packed", 4, 1);
    change(o);
    expect_error([&] { DataLoader loader(o); }, words);
  };
  expect_rejected([](LoaderOptions& o) { o.sources.clear(); }, {"no data sources"});
  expect_rejected([](LoaderOptions& o) { o.sources[0].weight = 0; }, {"source 0", "weight 0", "positive"});
  expect_rejected([](LoaderOptions& o) { o.sources[0].weight = -1; }, {"weight -1", "positive"});
  expect_rejected([](LoaderOptions& o) { o.seq_len = 0; }, {"seq_len is 0", "> 0"});
  expect_rejected([](LoaderOptions& o) { o.micro_batch = -2; }, {"micro_batch is -2", "> 0"});
  expect_rejected([](LoaderOptions& o) { o.mode = "ragged"; }, {"unknown mode \"ragged\"", "packed", "fixed"});
  expect_rejected([](LoaderOptions& o) { o.vocab_size = 0; }, {"vocab_size is 0"});
  expect_rejected([](LoaderOptions& o) { o.rank = 4, o.world = 4; }, {"rank 4 of world 4"});
}

// Synthetic rows (benchmarks): each target is the next id of its row, the global sequence does not
// depend on the data-parallel world, and sources are refused.
TEST(DataLoader, SyntheticRowsAreShiftedIdsAndTheSameForEveryWorld) {
  LoaderOptions one = options_for({}, "synthetic", 8, 2);
  one.vocab_size = 50;
  DataLoader single(one);
  std::vector<Plain> sequence;
  for (int i = 0; i < 4; ++i) sequence.push_back(plain(single.next()));
  for (const Plain& p : sequence) {
    ASSERT_EQ(p.inputs.size(), 16u);
    EXPECT_EQ(p.cu, (std::vector<int32_t>{0, 8, 16}));
    for (size_t t = 0; t + 1 < p.inputs.size(); ++t) {
      if ((t + 1) % 8 != 0) {
        EXPECT_EQ(p.targets[t], p.inputs[t + 1]) << "position " << t;
      }
    }
    for (int32_t id : p.inputs) EXPECT_TRUE(id >= 0 && id < 50) << id;
  }
  EXPECT_NE(sequence[0], sequence[1]);
  for (int rank = 0; rank < 2; ++rank) {
    LoaderOptions o = one;
    o.rank = rank;
    o.world = 2;
    DataLoader loader(o);
    EXPECT_EQ(plain(loader.next()), sequence[size_t(rank)]) << "rank " << rank;
    EXPECT_EQ(plain(loader.next()), sequence[size_t(2 + rank)]) << "rank " << rank;
  }
  LoaderOptions with_source = one;
  with_source.sources = {{"some/prefix", 1.0}};
  EXPECT_THROW(DataLoader{with_source}, Error);
}

}  // namespace
}  // namespace moetrain::train::data
