#!/usr/bin/env python3
# defines: a check that TensorBoard's own reader parses moetrain's event files: loads a folder of event files
# (metrics.tensorboard) with tensorboard's EventAccumulator and prints every scalar as JSON,
# {"tag": [[step, value], ...], ...}. Used by tests/train/tensorboard_test.cpp (skipped when tensorboard is not
# importable); by hand: python3 scripts/check_tensorboard.py runs/tiny_moe/tensorboard
import json
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: check_tensorboard.py EVENT_FOLDER", file=sys.stderr)
        return 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # size_guidance 0: keep every scalar (the default samples 10,000 per tag).
    accumulator = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags().get("scalars", [])
    if not tags:
        print(f"no scalars found in {sys.argv[1]}", file=sys.stderr)
        return 1
    out = {tag: [[event.step, event.value] for event in accumulator.Scalars(tag)] for tag in sorted(tags)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
