#!/usr/bin/env python3
"""Makes tests/data/tokenizer/, the fixtures of the C++ BPE tokenizer (src/train/data/bpe_tokenizer.h), with the
Hugging Face `tokenizers` library as the reference:

- corpus.jsonl: 110 seeded mixed documents and 17 hand-made ones (English, digits, punctuation, white-space runs, CR/LF, contractions in any
  case, precomposed and decomposed accents, Hangul, CJK, kana, emoji, other scripts, added tokens inside text);
- qwen/tokenizer.json: a byte-level BPE (vocab 2000) trained on a larger corpus made the same way with Qwen3's pre-tokenizer (Split(Qwen2 regex,
  Isolated) + ByteLevel(use_regex=false)), an NFC normaliser, the special tokens <|endoftext|>, <|im_start|>,
  <|im_end|> and non-special added tokens with every flag; qwen/expected_ids.jsonl: tokenizers' ids per document
  ({"doc": line index, "ids": [...]});
- gpt2/tokenizer.json (vocab 600, ByteLevel(use_regex=true), no normaliser), deepseek/tokenizer.json (vocab 500,
  DeepSeek-V3's three Splits, an empty normaliser Sequence, a BOS TemplateProcessing) and o200k/tokenizer.json
  (vocab 500, GPT-OSS's Split(o200k) + ByteLevel), each with expected_ids.jsonl (every fifth generated document and
  the hand-made ones);
- splits.jsonl: each known split pattern on tricky strings, pieces from tokenizers' pre_tokenize_str (checked
  against Python's `regex` module when it is installed);
- patterns.json: the regex strings of those patterns, as tokenizer.json files spell them;
- nfc.jsonl: NFC cases (unicodedata.normalize).

Run: /work/venv-golden/bin/python scripts/make_tokenizer_fixture.py   (tokenizers 0.23.3)
"""
import json
import os
import random
import unicodedata

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

try:
    import regex
except ImportError:
    regex = None

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "tokenizer")

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2 = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CL100K = QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
O200K = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
         r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
         r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# DeepSeek-V3's three Splits; its file spells CR and LF as the characters themselves in the third.
DEEPSEEK = [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+"
            "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]
PATTERNS = {"gpt2": [GPT2], "qwen2": [QWEN2], "cl100k": [CL100K], "o200k": [O200K], "deepseek_v3": DEEPSEEK}

WORDS = ("the of and to in is was he for it with as his on be at by I this had not are but from or have an they "
         "which one you were her all she there would their we him been has when who will more no if out so said what "
         "up its about into than them can only other new some could time these two may then do first any my now such "
         "like our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own see "
         "tokenizer merges bytes regex normalisation expert router gradient").split()
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ou", "ea", "ai")]
PIECES = [
    "don't", "it's", "We'RE", "THEY'LL", "you'Ve", "I'M", "she'D", "'tis", "rock'n'roll", "o'clock", "'ſ", "'S",
    "café", "cafe\u0301", "naïve", "nai\u0308ve", "Ñandú", "N\u0303andu\u0301", "Å", "A\u030a", "\u212b",
    "ẛ\u0323", "q\u0307\u0323", "\u1e0b\u0323", "한국어", "\u1112\u1161\u11ab", "\uac00\u11a8",
    "中文分词测试", "日本語のテキスト", "カタカナ", "ひらがな", "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷",
    "Привет мир", "Γειά σου", "مرحبا بالعالم", "שלום", "नमस्ते", "ǅemal", "ʰello", "ÉCOLE", "HTTPServer",
    "\u00a0nbsp", "\u3000ideographic", "thin\u2009space", "\u0301alone", "x\u0300\u0301\u0302",
    "3.14159", "1234567", "٣٤٥", "Ⅻ", "½", "$100", "50%", "#hashtag", "@user", "a/b/c", "https://example.com/x?y=1",
    "e-mail", "--flag", "...", "?!", "«quotes»", "“curly”", "(parens)", "[brackets]", "{braces}", "a_b", "__init__",
    "tab\there", "\t\tindent", "trailing   ", "   leading", "line\nbreak", "crlf\r\nline", "\n\n\n", " \n \n ",
    "\r", "end.\n", "x\u0001y", "<think>", "</think>", "Ñandú_token", "qux", "squx", "qux_", "[MASK]",
]


GENERATED = 110  # seeded documents; the hand-made ones follow


def make_corpus(generated=GENERATED):
    rng = random.Random(18)
    docs = []
    for _ in range(generated):
        parts = []
        for _ in range(rng.randint(5, 40)):
            r = rng.random()
            if r < 0.15:
                parts.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))))
            elif r < 0.62:
                w = rng.choice(WORDS)
                parts.append(w.capitalize() if rng.random() < 0.1 else w)
            elif r < 0.85:
                parts.append(rng.choice(PIECES))
            elif r < 0.92:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 7))))
            else:
                parts.append(rng.choice([",", ".", ";", ":", "!", "?", " -", "\n", "\n\n", "  ", "\t", "\r\n"]))
        text = ""
        for p in parts:
            text += p if (not text or text[-1].isspace() or p in ",.;:!?") else (" " if rng.random() < 0.9 else "") + p
        docs.append(text)
    # Hand-made documents: added tokens, their flags, and edge cases.
    docs += [
        "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nEasy.\n</think>\n4<|im_end|>",
        "first document<|endoftext|>second one, glued",
        "  <|im_start|>  spaces around a special token  <|im_end|>  ",
        "[MASK] a mask [MASK]at the start and end [MASK]",
        "qux stands alone, squx does not, qux_ neither, (qux) does, quxqux does not",
        "Ñandú_token precomposed and N\u0303andu\u0301_token decomposed are the same added token after NFC",
        "",
        " ",
        "\n",
        "a",
        "supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
        "x" * 300,
        "ab" * 150 + " " + "1" * 40,
        "\u0000nul and \u0001 controls \u007f\u0085next line",
        "emoji run: " + "😀😃😄😁" * 10,
        "mixed 中文English混合text and かなkana",
        "I'm sure they'RE here; it'S fine, we'Ll see, you'VE won, he'D go, 'M, 'T",
    ]
    return docs


def qwen_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([
        AddedToken("<think>", special=False, normalized=False),
        AddedToken("</think>", special=False, normalized=False),
        AddedToken("Ñandú_token", special=False, normalized=True),
        AddedToken("qux", special=False, normalized=False, single_word=True),
    ])
    tok.add_special_tokens([AddedToken("[MASK]", special=True, normalized=False, lstrip=True, rstrip=True)])
    return tok


def gpt2_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(corpus, trainer)
    return tok


def deepseek_tokenizer(corpus):
    """DeepSeek-V3's layout: an empty normaliser Sequence, its three Splits then ByteLevel, a BOS post-processor."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in DEEPSEEK] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    trainer = trainers.BpeTrainer(vocab_size=500, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=specials)
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<｜begin▁of▁sentence｜> $A", pair=None,
                                                       special_tokens=[(specials[0], 0)])
    return tok


def o200k_tokenizer(corpus):
    """GPT-OSS's layout: no normaliser, Split(o200k regex) then ByteLevel, <|endoftext|> and <|return|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|return|>"])
    tok.train_from_iterator(corpus, trainer)
    return tok


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")


def regex_isolated(pattern, pieces):
    out = []
    for piece in pieces:
        pos = 0
        for m in regex.finditer(pattern, piece):
            if m.start() > pos:
                out.append(piece[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(piece):
            out.append(piece[pos:])
    return out


def splits_rows():
    texts = PIECES + [
        "Hello world", " Hello  world ", "x  y", "a \n b", "a\n\n  b", "  \n\t x", "word's", "WORD'S", "it'sn't",
        "'", "''s", "a'b", "   ", "\n", "x\r\n\r\ny", "foo.\n\nbar", "foo!!\n", "a/\nb", "  !!", " !?x", "123abc456",
        "abc123", " 12 345 6789", "HELLOworld", "helloWORLD", "camelCaseWord", "ǅungla", "ʰʰa", "AʰB", "x\u0301y",
        " \u0301x", "\u0301 ", "ÉCOLE'S", "Qu'est-ce", "中文abc日本", "한국어 텍스트", "😀 😀", "a\u00a0b", "a\u3000 b",
        "tab\t\tend", "end\t", "A-Za", "-Za", ".abc", ",Abc", "\"quoted\"", "`code`", "~tilde", "mixed中文and",
        "ʰ", "Ⅻ roman", "½ half", "x\u0001y", "\u0085", " \u0085x",
    ]
    rows = []
    for name, patterns in PATTERNS.items():
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False)
                                       for p in patterns])
        for text in texts:
            pieces = [p for p, _ in pre.pre_tokenize_str(text)]
            if regex is not None:
                mine = [text]
                for p in patterns:
                    mine = regex_isolated(p, mine)
                assert mine == pieces, (name, text, mine, pieces)
            rows.append({"pattern": name, "text": text, "pieces": pieces})
    return rows


def main():
    for name in ("qwen", "gpt2", "deepseek", "o200k"):
        os.makedirs(os.path.join(OUT, name), exist_ok=True)
    corpus = make_corpus()
    training = make_corpus(600)  # a larger corpus (not kept) to reach the vocabulary size; it starts with `corpus`
    write_jsonl(os.path.join(OUT, "corpus.jsonl"), [{"id": k, "text": t} for k, t in enumerate(corpus)])
    makers = (("qwen", qwen_tokenizer), ("gpt2", gpt2_tokenizer), ("deepseek", deepseek_tokenizer),
              ("o200k", o200k_tokenizer))
    for name, make in makers:
        tok = make(training)
        path = os.path.join(OUT, name, "tokenizer.json")
        tok.save(path, pretty=False)
        tok = Tokenizer.from_file(path)  # the ids of the file as saved
        # The smaller fixtures keep the ids of every fifth generated document and of every hand-made one (size).
        docs = [k for k in range(len(corpus)) if name == "qwen" or k % 5 == 0 or k >= GENERATED]
        ids = [e.ids for e in tok.encode_batch([corpus[k] for k in docs], add_special_tokens=False)]
        write_jsonl(os.path.join(OUT, name, "expected_ids.jsonl"), [{"doc": k, "ids": i} for k, i in zip(docs, ids)])
    write_jsonl(os.path.join(OUT, "splits.jsonl"), splits_rows())
    with open(os.path.join(OUT, "patterns.json"), "w", encoding="utf-8") as f:
        json.dump(PATTERNS, f, ensure_ascii=False, indent=1)
        f.write("\n")
    nfc = ["café", "cafe\u0301", "A\u030a", "\u212b", "ẛ\u0323", "q\u0307\u0323", "\u1e0b\u0323", "\u1112\u1161\u11ab",
           "\uac00\u11a8", "x\u0300\u0301\u0302", "a\u0328\u0301", "\u0344", "\u0958", "\uf900", "e\u0301\u0301",
           "\u0301e", "ascii only", "中文", "o\u0308\u0304", "\u05d0\u05b8\u05bc", "\u1100\u1161\u11a8\u0301",
           "Ñandú_token", "N\u0303andu\u0301_token", "\u2126", "\u0041\u030a\u0301", "\u1fb3\u0301"]
    write_jsonl(os.path.join(OUT, "nfc.jsonl"), [{"text": t, "nfc": unicodedata.normalize("NFC", t)} for t in nfc])


if __name__ == "__main__":
    main()
