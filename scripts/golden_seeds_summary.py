# defines: the summary of scripts/golden_seeds.sh: per family and case, how many dumps fail check-golden's per-tensor
# bf16 judgement (any [FAIL] line), and the distribution of error / theirs per gradient tensor (the relative error
# over transformers' own bf16ref error; the rule allows 1.5x, plus 2^-8, plus 4 spreads of the bf16 rounding
# ensemble, which --every-tensor always measures and lists); with the variants' JSON beside them, the same for
# transformers' own more precise bf16 runs (scripts/bf16_variants.py), judged by the bounds check-golden listed for
# ours on the same dump: without the ensemble's spreads, and with them.
# Usage: python3 scripts/golden_seeds_summary.py RESULTS_DIR
import glob, json, os, re, sys

LINE = re.compile(r"^\[info\] ((?:batch|packed)/(?:grads|logits))\s+ours (\S+) theirs (\S+) bound \S+ \(\S+ of it\) "
                  r"(\S+)(?: spread (\S+))?")
FLOOR, FACTOR, SPREADS = 1.0 / 256.0, 1.5, 4.0  # check_golden_judge.h: kBf16Floor, kBf16Factor, kEnsembleSpreads


def bound(theirs, spread=0.0):
    return FACTOR * theirs + FLOOR + SPREADS * spread


def describe(label, ratios, failing, dumps, extra=""):
    s = sorted(ratios)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]
    return (f"  {label:<24} dumps failing {failing}{extra} of {dumps:2d}; error / theirs over {len(s)} tensors: "
            f"median {q(0.5):.2f}, 90% {q(0.9):.2f}, 99% {q(0.99):.2f}, max {s[-1]:.2f}")


def main(out):
    groups, spreads = {}, {}
    for path in sorted(glob.glob(os.path.join(out, "check", "*.log"))):
        tag, case = os.path.basename(path)[:-4].rsplit("_", 1)
        seed, family = tag.split("_", 1)
        text = open(path).read()
        rows = [m for m in map(LINE.match, text.splitlines()) if m]
        grads = [m for m in rows if m.group(1).endswith("grads")]
        g = groups.setdefault((family, case), {"ratios": [], "failing": 0, "unwidened": 0, "dumps": 0})
        g["ratios"] += [float(m.group(2)) / float(m.group(3)) for m in grads]
        g["failing"] += "[FAIL]" in text
        g["unwidened"] += any(float(m.group(2)) > bound(float(m.group(3))) for m in rows)
        g["dumps"] += 1
        if case == "batch":
            spreads[tag] = {("logits" if m.group(1).endswith("logits") else m.group(4)): float(m.group(5) or 0)
                            for m in rows}
    for (family, case), g in sorted(groups.items()):
        print(f"{family} {case}")
        if g["ratios"]:
            print(describe("moetrain", g["ratios"], g["failing"], g["dumps"],
                           f" ({g['unwidened']} by the bounds without spreads)"))
        if case != "batch":
            continue
        for variant in ("V1", "V12"):
            ratios, failing, unwidened, dumps = [], 0, 0, 0
            for path in sorted(glob.glob(os.path.join(out, "variants", f"*_{family}.json"))):
                tag = os.path.basename(path)[:-5]
                v = json.load(open(path))
                spread = spreads.get(tag, {})
                ratios += [v[variant][k] / t for k, t in v["theirs"].items() if k != "logits"]
                unwidened += any(v[variant][k] > bound(t) for k, t in v["theirs"].items())
                failing += any(v[variant][k] > bound(t, spread[k]) for k, t in v["theirs"].items() if k in spread)
                dumps += 1
            if dumps:
                print(describe(f"transformers {variant}", ratios, failing, dumps,
                               f" ({unwidened} by the bounds without spreads)"))


if __name__ == "__main__":
    main(sys.argv[1])
