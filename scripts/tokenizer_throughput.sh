#!/usr/bin/env bash
# Times `moetrain data prepare --tokenizer` against the Hugging Face tokenizers library's encode_batch on the same
# corpus and machine: a ~50 MB JSONL made from the text files of /usr/share/doc and /usr/share/common-licenses
# (paragraphs shuffled with a fixed seed), encoded with the Qwen-style fixture tokenizer (tests/data/tokenizer/qwen).
# Usage: bash scripts/tokenizer_throughput.sh [THREADS] [MB]   (defaults: nproc, 50)
# Needs build/src/moetrain (or $MOETRAIN) and a Python with tokenizers ($PYTHON, default /work/venv-golden/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-$(nproc)}
MB=${2:-50}
MOETRAIN=${MOETRAIN:-build/src/moetrain}
PYTHON=${PYTHON:-/work/venv-golden/bin/python}
TOKENIZER=tests/data/tokenizer/qwen/tokenizer.json
WORK=$(mktemp -d /tmp/tokenizer_throughput.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" - "$WORK/corpus.jsonl" "$MB" <<'PY'
import glob, gzip, json, random, sys
paragraphs = []
files = glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/*/*")
for path in sorted(files):
    try:
        raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        continue
    paragraphs += [p for p in text.split("\n\n") if p.strip()]
rng = random.Random(0)
target = int(sys.argv[2]) * 1_000_000
size = 0
with open(sys.argv[1], "w", encoding="utf-8") as f:
    while size < target:
        rng.shuffle(paragraphs)
        for k in range(0, len(paragraphs), 8):
            line = json.dumps({"text": "\n\n".join(paragraphs[k:k + 8])}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            if size >= target:
                break
print(f"corpus: {size / 1e6:.1f} MB from {len(paragraphs)} paragraphs", file=sys.stderr)
PY

echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), load $(cut -d' ' -f1-3 /proc/loadavg)"
start=$(date +%s.%N)
"$MOETRAIN" data prepare --tokenizer "$TOKENIZER" --input "$WORK/corpus.jsonl" --text-field text \
  --output "$WORK/out" --threads "$THREADS" > "$WORK/moetrain.log" 2>/dev/null
end=$(date +%s.%N)
tail -1 "$WORK/moetrain.log"
echo "moetrain data prepare --threads $THREADS: $(echo "$end - $start" | bc) s wall (tokenizer load and output included)"

RAYON_NUM_THREADS=$THREADS TOKENIZERS_PARALLELISM=true "$PYTHON" - "$WORK/corpus.jsonl" "$TOKENIZER" "$THREADS" \
  "$WORK/out" <<'PY'
import json, sys, time
import numpy as np
from tokenizers import Tokenizer
texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
size = sum(len(t.encode("utf-8")) for t in texts) / 1e6
tok = Tokenizer.from_file(sys.argv[2])
start = time.perf_counter()
ids = []
for k in range(0, len(texts), 1000):
    ids += [e.ids for e in tok.encode_batch(texts[k:k + 1000], add_special_tokens=False)]
seconds = time.perf_counter() - start
tokens = sum(len(i) for i in ids)
print(f"tokenizers encode_batch (RAYON_NUM_THREADS={sys.argv[3]}): {size:.1f} MB of text, {tokens} tokens in "
      f"{seconds:.1f} s ({size / seconds:.2f} MB/s; JSON parsing not timed)")
start = time.perf_counter()
for k in range(0, len(texts), 1000):
    tok.encode_batch_fast(texts[k:k + 1000], add_special_tokens=False)
fast = time.perf_counter() - start
print(f"tokenizers encode_batch_fast (no offsets): {fast:.1f} s ({size / fast:.2f} MB/s)")
# The ids moetrain wrote (Megatron .idx: 34-byte header, int32 sizes, int64 pointers) must be the same + the EOD.
idx = open(sys.argv[4] + ".idx", "rb").read()
dtype = {8: np.uint16, 4: np.int32}[idx[17]]
n = int.from_bytes(idx[18:26], "little")
sizes = np.frombuffer(idx, np.int32, n, 34)
bin_ids = np.fromfile(sys.argv[4] + ".bin", dtype)
expected = [i + [0] for i in ids if i]
same = len(expected) == n and all(len(e) == s for e, s in zip(expected, sizes))
same = same and np.array_equal(bin_ids.astype(np.int64), np.concatenate([np.array(e, np.int64) for e in expected]))
print(f"ids identical to tokenizers' on all {len(expected)} documents: {same}")
sys.exit(0 if same else 1)
PY
