#!/usr/bin/env bash
# defines: the long-run memory check of the tiny example on the CPU: train STEPS steps (default 10,000; checkpoints
# every 1,000, two kept; TensorBoard events and, when scripts/run.sh made its data, the held-out evaluation on) and
# print the process's resident memory (VmRSS) at every 1,000th step and the last, as the trainer itself records it
# after each step (host_rss_bytes in the metrics file): a leak shows as growth between step 1,000 and the last.
# Needs the data of scripts/run.sh (runs/data/licenses) and a built binary (MOETRAIN, default build-cpu/src/moetrain).
#   bash scripts/rss_check.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-10000}"
binary="${MOETRAIN:-build-cpu/src/moetrain}"
work="${RSS_WORKDIR:-/tmp/moetrain_rss}"
rm -rf "$work" && mkdir -p "$work"
eval_args=(--metrics.tensorboard="$work/tensorboard")
[[ -f runs/data/licenses_heldout.idx ]] || eval_args+=(--eval.every=0)
"$binary" train --config examples/tiny_moe/job.toml "${eval_args[@]}" --train.steps="$steps" --checkpoint.dir="$work/ckpt" \
  --checkpoint.every=1000 --metrics.console_every=1000 --metrics.jsonl="$work/metrics.jsonl" >"$work/train.log" 2>&1
tail -1 "$work/train.log"
python3 - "$work/metrics.jsonl" "$steps" <<'PY'
import json, sys
path, last = sys.argv[1], int(sys.argv[2])
for line in open(path):
    record = json.loads(line)
    if record["step"] % 1000 == 0 or record["step"] == last:
        print(f"step {record['step']}: RSS {record.get('host_rss_bytes', 0) // 1024} kB")
PY
