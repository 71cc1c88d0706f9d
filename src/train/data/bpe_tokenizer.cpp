// defines: encoding with BpeTokenizer, in the tokenizers library's order: added tokens split out of the raw text,
// the rest normalised, normalised added tokens split out, pre-tokenized by the split patterns, and each piece's bytes
// merged by rank (the lowest rank first, the leftmost among equals, as tokenizers' Word::merge_all does).
#include "train/data/bpe_tokenizer.h"

#include <algorithm>
#include <functional>

#include "core/error.h"
#include "train/data/unicode.h"

namespace moetrain::train::data {

namespace {

// Rust's char::is_alphanumeric (Alphabetic or a number) or '_': a word character for single_word.
bool is_word_char(char32_t cp) {
  const uint8_t props = unicode::properties(cp);
  return cp == '_' || (props & unicode::kAlphabeticBit) != 0 || unicode::is_number(unicode::category(props));
}
bool is_space(char32_t cp) { return (unicode::properties(cp) & unicode::kWhiteSpaceBit) != 0; }

// The code point ending at byte `end` of valid UTF-8 text, and its start in *start.
char32_t last_char(std::string_view text, size_t end, size_t* start) {
  size_t s = end - 1;
  while (s > 0 && (static_cast<unsigned char>(text[s]) & 0xC0) == 0x80) --s;
  int n = 0;
  const char32_t cp = unicode::decode_utf8(text, s, &n);
  *start = s;
  return cp;
}

}  // namespace

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  BpeEncoder encoder(*this, 0);
  std::vector<int32_t> ids;
  encoder.encode(text, ids);
  return ids;
}

BpeEncoder::BpeEncoder(const BpeTokenizer& tokenizer, size_t cache_entries)
    : tok_(tokenizer), cache_entries_(cache_entries) {}

// tokenizers' AddedVocabulary::find_matches: leftmost-longest matches, then the single_word, lstrip and rstrip rules.
void BpeEncoder::find_added(std::string_view text, const BpeTokenizer::AddedMatcher& matcher,
                            std::vector<Segment>& out) const {
  out.clear();
  if (matcher.empty) {
    out.push_back({-1, 0, text.size()});
    return;
  }
  size_t start_offset = 0;
  for (size_t pos = 0; pos < text.size();) {
    const auto& candidates = matcher.by_first_byte[static_cast<unsigned char>(text[pos])];
    int32_t index = -1;
    size_t length = 0;
    for (const auto& [pattern, k] : candidates) {
      if (text.compare(pos, pattern.size(), pattern) == 0) {
        index = k;
        length = pattern.size();
        break;
      }
    }
    if (index < 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + length;
    pos = stop;  // the next match is searched after this one, whatever the rules below decide
    const AddedToken& token = tok_.added_[index];
    if (token.single_word) {
      size_t s = 0;
      const bool start_space = start == 0 || !is_word_char(last_char(text, start, &s));
      int n = 0;
      const bool stop_space = stop == text.size() || !is_word_char(unicode::decode_utf8(text, stop, &n));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) {
      size_t s = start;
      while (s > 0) {
        size_t prev = 0;
        if (!is_space(last_char(text, s, &prev))) break;
        s = prev;
      }
      start = std::max(s, start_offset);
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        int n = 0;
        if (!is_space(unicode::decode_utf8(text, stop, &n))) break;
        stop += n;
      }
    }
    if (start_offset < start) out.push_back({-1, start_offset, start});
    out.push_back({index, start, stop});
    start_offset = stop;
  }
  if (start_offset != text.size()) out.push_back({-1, start_offset, text.size()});
}

void BpeEncoder::encode(std::string_view text, std::vector<int32_t>& out) {
  find_added(text, tok_.raw_matcher_, raw_segments_);
  for (const Segment& seg : raw_segments_) {
    if (seg.added >= 0) {
      out.push_back(tok_.added_[seg.added].id);
      continue;
    }
    std::string_view piece = text.substr(seg.begin, seg.end - seg.begin);
    if (piece.empty()) continue;
    std::string normalized;
    if (tok_.nfc_ && !unicode::is_nfc_quick(piece)) {
      normalized = unicode::nfc(piece);
      piece = normalized;
    }
    find_added(piece, tok_.normalized_matcher_, norm_segments_);
    for (const Segment& s : norm_segments_) {
      if (s.added >= 0) {
        out.push_back(tok_.added_[s.added].id);
      } else if (s.end > s.begin) {
        encode_text(piece.substr(s.begin, s.end - s.begin), out);
      }
    }
  }
}

void BpeEncoder::encode_text(std::string_view text, std::vector<int32_t>& out) {
  if (tok_.splits_.empty()) {
    encode_word(text, out);
    return;
  }
  cps_.assign(text);
  pieces_.assign(1, {0, static_cast<uint32_t>(cps_.size())});
  for (SplitPattern pattern : tok_.splits_) {
    next_pieces_.clear();
    for (const auto& [b, e] : pieces_) split_isolated(pattern, cps_, b, e, next_pieces_);
    std::swap(pieces_, next_pieces_);
  }
  for (const auto& [b, e] : pieces_) {
    encode_word(text.substr(cps_.offset[b], cps_.offset[e] - cps_.offset[b]), out);
  }
}

void BpeEncoder::encode_word(std::string_view word, std::vector<int32_t>& out) {
  if (cache_entries_ == 0) {
    bpe(word, out);
    return;
  }
  const std::string key(word);
  if (const auto it = cache_.find(key); it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t first = out.size();
  bpe(word, out);
  if (cache_.size() >= cache_entries_) cache_.clear();  // bounded: start over rather than grow
  cache_.emplace(key, std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

void BpeEncoder::bpe(std::string_view word, std::vector<int32_t>& out) {
  if (tok_.ignore_merges_) {
    if (const auto it = tok_.bytes_to_id_.find(std::string(word)); it != tok_.bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // One symbol per byte; a byte outside the vocabulary becomes unk (fused with a preceding unk when fuse_unk) or,
  // without an unk token, is dropped, as tokenizers' merge_word does.
  symbols_.clear();
  bool last_unk = false;
  for (unsigned char b : word) {
    const int32_t id = tok_.byte_id_[b];
    if (id >= 0) {
      symbols_.push_back({id, 0, 0, 1});
      last_unk = false;
    } else if (tok_.unk_id_.has_value()) {
      if (last_unk && tok_.fuse_unk_) {
        symbols_.back().len += 1;
      } else {
        symbols_.push_back({*tok_.unk_id_, 0, 0, 1});
      }
      last_unk = true;
    }
  }
  const int32_t n = static_cast<int32_t>(symbols_.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols_[i].prev = i - 1;
    symbols_[i].next = i + 1 < n ? i + 1 : -1;
  }
  const auto find_merge = [&](int32_t a, int32_t b) -> const BpeTokenizer::Merge* {
    const auto it = tok_.merges_.find((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b));
    return it == tok_.merges_.end() ? nullptr : &it->second;
  };
  // Min-heap on (rank, position).
  queue_.clear();
  const auto greater = std::greater<std::pair<uint64_t, int32_t>>();
  const auto push = [&](int32_t pos, const BpeTokenizer::Merge& m) {
    queue_.emplace_back((static_cast<uint64_t>(m.rank) << 32) | static_cast<uint32_t>(pos), m.new_id);
    std::push_heap(queue_.begin(), queue_.end(), greater);
  };
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const auto* m = find_merge(symbols_[i].id, symbols_[i + 1].id)) push(i, *m);
  }
  while (!queue_.empty()) {
    std::pop_heap(queue_.begin(), queue_.end(), greater);
    const auto [key, new_id] = queue_.back();
    queue_.pop_back();
    const int32_t pos = static_cast<int32_t>(key & 0xffffffffu);
    Symbol& left = symbols_[pos];
    if (left.len == 0 || left.next < 0) continue;  // merged away, or the last symbol
    const Symbol right = symbols_[left.next];
    const auto* current = find_merge(left.id, right.id);
    if (current == nullptr || current->new_id != new_id) continue;  // a stale entry
    symbols_[left.next].len = 0;
    left.id = new_id;
    left.len += right.len;
    left.next = right.next;
    if (right.next >= 0) symbols_[right.next].prev = pos;
    if (left.prev >= 0) {
      if (const auto* m = find_merge(symbols_[left.prev].id, left.id)) push(left.prev, *m);
    }
    if (left.next >= 0) {
      if (const auto* m = find_merge(left.id, symbols_[left.next].id)) push(pos, *m);
    }
  }
  for (int32_t i = 0; i < n; ++i) {
    if (symbols_[i].len > 0) out.push_back(symbols_[i].id);
  }
}

}  // namespace moetrain::train::data
