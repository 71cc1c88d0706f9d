#!/usr/bin/env bash
# defines: the long-run memory check of the tiny example on the CPU: train STEPS steps (default 10,000; checkpoints
# every 1,000, two kept) and sample the process's resident memory (VmRSS) as the steps go by; prints the RSS at every
# 1,000th step, so a leak shows as growth between step 1,000 and the last. Needs the data of scripts/run.sh
# (runs/data/licenses) and a built binary (MOETRAIN, default build-cpu/src/moetrain).
#   bash scripts/rss_check.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-10000}"
binary="${MOETRAIN:-build-cpu/src/moetrain}"
work="${RSS_WORKDIR:-/tmp/moetrain_rss}"
rm -rf "$work" && mkdir -p "$work"
# The job's held-out evaluation when scripts/run.sh made its data, and its TensorBoard events, run along.
eval_args=(--metrics.tensorboard="$work/tensorboard")
[[ -f runs/data/licenses_heldout.idx ]] || eval_args+=(--eval.every=0)
"$binary" train --config examples/tiny_moe/job.toml "${eval_args[@]}" --train.steps="$steps" --checkpoint.dir="$work/ckpt" \
  --checkpoint.every=1000 --metrics.console_every=1000 --metrics.jsonl="$work/metrics.jsonl" >"$work/train.log" 2>&1 &
pid=$!
last=0
while kill -0 "$pid" 2>/dev/null; do
  step=$(grep -oE "step [0-9]+/" "$work/train.log" | tail -1 | tr -dc 0-9 || true)
  if [[ -n "$step" && "$step" != "$last" ]]; then
    rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo "?")
    echo "step $step: RSS $rss kB"
    last=$step
  fi
  sleep 1
done
wait "$pid"
tail -1 "$work/train.log"
