# defines: the summary of scripts/golden_seeds.sh: per family and case, how many dumps fail check-golden's per-tensor
# bf16 judgement (any [FAIL] line), and the distribution of error / theirs per gradient tensor (the relative error
# over transformers' own bf16ref error; the rule allows 1.5x, plus 2^-8);
# with the variants' JSON beside them, the same for transformers' own more precise bf16 runs (scripts/bf16_variants.py).
# Usage: python3 scripts/golden_seeds_summary.py RESULTS_DIR
import glob, json, os, re, statistics, sys

LINE = re.compile(r"^\[info\] ((?:batch|packed)/grads)\s+ours (\S+) theirs (\S+) bound \S+ \(\S+ of it\) (\S+)")


def bound(theirs):
    return 1.5 * theirs + 1.0 / 256.0  # check_golden_judge.h: kBf16Factor x theirs + kBf16Floor


def describe(label, ratios, failing, dumps):
    s = sorted(ratios)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]
    return (f"  {label:<24} dumps failing {failing:2d} of {dumps:2d}; error / theirs over {len(s)} tensors: "
            f"median {q(0.5):.2f}, 90% {q(0.9):.2f}, 99% {q(0.99):.2f}, max {s[-1]:.2f}")


def main(out):
    logs = sorted(glob.glob(os.path.join(out, "check", "*.log")))
    groups = {}
    for path in logs:
        tag, case = os.path.basename(path)[:-4].rsplit("_", 1)
        seed, family = tag.split("_", 1)
        text = open(path).read()
        ratios = [float(m.group(2)) / float(m.group(3)) for m in map(LINE.match, text.splitlines()) if m]
        g = groups.setdefault((family, case), {"ratios": [], "failing": 0, "dumps": 0})
        g["ratios"] += ratios
        g["failing"] += "[FAIL]" in text
        g["dumps"] += 1
    for (family, case), g in sorted(groups.items()):
        print(f"{family} {case}")
        if g["ratios"]:
            print(describe("moetrain", g["ratios"], g["failing"], g["dumps"]))
        if case != "batch":
            continue
        for variant in ("V1", "V12"):
            ratios, failing, dumps = [], 0, 0
            for path in sorted(glob.glob(os.path.join(out, "variants", f"*_{family}.json"))):
                v = json.load(open(path))
                theirs = {k: t for k, t in v["theirs"].items() if k != "logits"}
                ratios += [v[variant][k] / t for k, t in theirs.items()]
                failing += any(v[variant][k] > bound(t) for k, t in theirs.items())
                dumps += 1
            if dumps:
                print(describe(f"transformers {variant}", ratios, failing, dumps))


if __name__ == "__main__":
    main(sys.argv[1])
