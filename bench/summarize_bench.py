#!/usr/bin/env python3
# defines: the summary line of one benchmark run, shared by bench/run_bench.sh and bench/run_shapes_bench.sh: moetrain's
# tokens/s, MFU and peak from bench_moetrain.json, then each PyTorch baseline found beside it
# (bench_torch_<prec>_acc8.json from bench/torch_baseline.py, eager and compiled) with the ratio moetrain / torch, and
# each side's GPU energy a step where NVML could read it (a step at the power limit is as fast as its energy allows).
# Usage: python3 bench/summarize_bench.py RESULTS_DIR [LABEL]
import json
import os
import sys


def main():
    if len(sys.argv) not in (2, 3):
        print("usage: summarize_bench.py RESULTS_DIR [LABEL]", file=sys.stderr)
        return 2
    out = sys.argv[1]
    label = sys.argv[2] + ": " if len(sys.argv) == 3 else ""
    ours = json.load(open(os.path.join(out, "bench_moetrain.json")))
    energy = ours.get("energy")
    print(f"{label}moetrain: {ours['tokens_per_s']:.0f} tokens/s, {100 * ours['mfu_vs_989']:.1f}% MFU, "
          f"peak {ours['memory']['peak_GiB']:.1f} GiB"
          + (f", {energy['joules_per_step']:.0f} J/step at {energy['mean_power_W']:.0f} W" if energy else ""))
    for prec in ("amp", "bf16"):
        path = os.path.join(out, f"bench_torch_{prec}_acc8.json")
        if not os.path.exists(path):
            continue
        t = json.load(open(path))
        for mode in ("eager", "compiled"):
            if f"{mode}_tok_s" not in t:
                continue
            joules = t.get(f"{mode}_joules_per_step")
            print(f"{label}torch {prec} {mode}: {t[f'{mode}_tok_s']:.0f} tokens/s, "
                  f"{100 * t[f'{mode}_mfu_vs_989']:.1f}% MFU, peak {t[f'{mode}_peak_GiB']:.1f} GiB"
                  + (f", {joules:.0f} J/step at {t[f'{mode}_mean_power_W']:.0f} W" if joules else "")
                  + f" -> moetrain / torch = {ours['tokens_per_s'] / t[f'{mode}_tok_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
