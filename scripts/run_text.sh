#!/usr/bin/env bash
# defines: training on real text end to end, on the CPU: the license texts of /usr/share/common-licenses (training)
# and the copyright files of /usr/share/doc (held out) as JSONL, tokenised by `moetrain data prepare --tokenizer`
# with the byte-level BPE of tests/data/tokenizer/qwen, then the tiny Qwen3-MoE of examples/tiny_moe_text trained on
# them with a held-out loss every 25 steps and TensorBoard events, and the run's page written by `moetrain report`
# (runs/tiny_moe_text/report.html). Extra arguments are passed to `moetrain train` as overrides. Needs python3 (to
# write the JSONL) and a built binary (scripts/build.sh; MOETRAIN overrides the path).
set -euo pipefail
cd "$(dirname "$0")/.."
moetrain="${MOETRAIN:-./build/src/moetrain}"
tokenizer=tests/data/tokenizer/qwen/tokenizer.json
mkdir -p runs/data runs/tiny_moe_text
# One JSON object per file: {"text": <the file's text>}.
to_jsonl() {
  python3 -c 'import json, sys
for path in sys.argv[2:]:
    with open(path, encoding="utf-8", errors="replace") as f:
        print(json.dumps({"text": f.read()}))' - "$@"
}
if [[ ! -f runs/data/licenses_bpe.idx ]]; then
  mapfile -t texts < <(find /usr/share/common-licenses -type f | sort)
  to_jsonl "${texts[@]}" >runs/data/licenses.jsonl
  "$moetrain" data prepare --tokenizer "$tokenizer" --input runs/data/licenses.jsonl --output runs/data/licenses_bpe
fi
if [[ ! -f runs/data/licenses_bpe_heldout.idx ]]; then
  mapfile -t heldout < <(find /usr/share/doc -mindepth 2 -maxdepth 2 -name copyright -type f 2>/dev/null | sort | head -n 64)
  (( ${#heldout[@]} > 0 )) || { echo "run_text: no /usr/share/doc/*/copyright files for the held-out set" >&2; exit 1; }
  to_jsonl "${heldout[@]}" >runs/data/licenses_heldout.jsonl
  "$moetrain" data prepare --tokenizer "$tokenizer" --input runs/data/licenses_heldout.jsonl \
    --output runs/data/licenses_bpe_heldout
fi
"$moetrain" train --config examples/tiny_moe_text/job.toml "$@"
"$moetrain" report --metrics runs/tiny_moe_text/metrics.jsonl --config examples/tiny_moe_text/job.toml \
  --out runs/tiny_moe_text/report.html
