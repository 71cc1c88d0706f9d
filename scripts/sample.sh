#!/usr/bin/env bash
# defines: sampling from the README's main job (the tiny Qwen3-MoE of examples/tiny_moe, byte-level tokens): each
# argument is a prompt; their bytes become the rows of a generate input, `moetrain generate` continues them from the
# newest checkpoint in runs/tiny_moe/checkpoints (random weights before scripts/run.sh has trained any), and the
# continuations are printed as text with their mean log-prob per byte. Needs a built moetrain (scripts/build.sh) and
# python3 (standard library only).
#   bash scripts/sample.sh "Permission is hereby granted" "THE SOFTWARE IS PROVIDED"
# Environment: NEW_TOKENS (default 96), TEMPERATURE (default 0.7), SEED (default 1), MOETRAIN (the binary).
set -euo pipefail
cd "$(dirname "$0")/.."
(( $# > 0 )) || set -- "Permission is hereby granted" "This program is free software"
binary="${MOETRAIN:-./build/src/moetrain}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
# The prompts as byte tokens (0-255), rows padded to the longest; lengths give each row's prompt.
python3 - "$dir/prompts.safetensors" "$@" <<'PY'
import json, struct, sys
path, prompts = sys.argv[1], [p.encode() for p in sys.argv[2:]]
width = max(len(p) for p in prompts)
ids = [b for p in prompts for b in p + bytes(width - len(p))]
tensors = {"input_ids": ("I32", [len(prompts), width], ids), "lengths": ("I32", [len(prompts)], [len(p) for p in prompts])}
header, data = {}, b""
for name, (dtype, shape, values) in tensors.items():
    raw = struct.pack("<%di" % len(values), *values)
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
    data += raw
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(path, "wb").write(struct.pack("<Q", len(text)) + text + data)
PY
"$binary" generate --config examples/tiny_moe/job.toml --input "$dir/prompts.safetensors" --out "$dir/out.safetensors" \
  --max-new-tokens "${NEW_TOKENS:-96}" --temperature "${TEMPERATURE:-0.7}" --seed "${SEED:-1}" 2>&1 | grep -E "weights|error"
python3 - "$dir/out.safetensors" "$@" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
size = struct.unpack("<Q", raw[:8])[0]
header, body = json.loads(raw[8:8 + size]), raw[8 + size:]
def tensor(name):
    meta = header[name]
    begin, end = meta["data_offsets"]
    values = struct.unpack("<%d%s" % ((end - begin) // 4, "i" if meta["dtype"] == "I32" else "f"), body[begin:end])
    rows, cols = meta["shape"]
    return [values[r * cols:(r + 1) * cols] for r in range(rows)]
tokens, logprobs = tensor("tokens"), tensor("logprobs")
for prompt, row, lp in zip(sys.argv[2:], tokens, logprobs):
    new = row[len(prompt.encode()):len(prompt.encode()) + len(lp)]
    # 256 ends a document.
    text = bytes(t for t in new if 0 <= t < 256).decode("utf-8", "replace") if 256 not in new else \
        bytes(t for t in new[:new.index(256)]).decode("utf-8", "replace") + " <end of document>"
    print(f"{prompt}|{text}")
    print(f"  (mean log-prob {sum(lp) / len(lp):.3f} nats per byte)")
PY
