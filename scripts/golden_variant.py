#!/usr/bin/env python3
# defines: the DeepSeek-V2 variants of the shared reference-dump script (../shared/golden/make_golden.py), applied to a
# copy of it in place, for scripts/make_golden_cpu.sh and scripts/golden_seeds.sh. The public dump runs the default
# rope and greedy top-k; these make transformers run what the engine also claims:
#   --yarn           YaRN: factor 40 over an original context of 32 tokens (the ramp falls inside the rotary dims at the
#                    dumps' lengths), mscale 1 and mscale_all_dim 0.8 (the cos / sin attention factor and the softmax
#                    temperature both differ from 1);
#   --group-limited  group-limited greedy top-k as DeepSeek-V2 (236B) routes: the 8 experts in 4 groups of 2, the
#                    tokens' 2 best groups kept, routed_scaling_factor 16.
# Usage: python3 scripts/golden_variant.py make_golden.py [--yarn] [--group-limited]
# Each edit must match exactly once, so a changed shared script fails here instead of making another model.
import argparse
import sys

YARN = (
    'scoring_func="softmax", max_position_embeddings=4096',
    'scoring_func="softmax", max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, '
    '"factor": 40.0, "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, '
    '"mscale_all_dim": 0.8}',
)
GROUP_LIMITED = (
    'topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0',
    'topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=16.0',
)


def main() -> int:
    parser = argparse.ArgumentParser(description="apply DeepSeek-V2 variants to a copy of make_golden.py")
    parser.add_argument("path")
    parser.add_argument("--yarn", action="store_true")
    parser.add_argument("--group-limited", action="store_true")
    args = parser.parse_args()
    text = open(args.path).read()
    edits = [edit for edit, wanted in ((YARN, args.yarn), (GROUP_LIMITED, args.group_limited)) if wanted]
    for old, new in edits:
        count = text.count(old)
        if count != 1:
            print(f"golden_variant: expected one '{old}' in {args.path}, found {count}", file=sys.stderr)
            return 1
        text = text.replace(old, new)
    open(args.path, "w").write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
