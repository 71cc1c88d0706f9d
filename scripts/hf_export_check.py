#!/usr/bin/env python3
# Checks that Hugging Face transformers reloads moetrain's HF export and computes the same log-probs.
#
# Given a model config.json (e.g. tests/data/golden/deepseek_v2/config.json or .../qwen3_moe/config.json) it:
#   1. writes a job TOML in --workdir (random init, synthetic data, 3 steps on the CPU, a checkpoint at step 3)
#      and runs `moetrain train`;
#   2. runs `moetrain convert --checkpoint` to export that checkpoint as an HF folder (--dtype f32 or bf16);
#   3. writes input_ids int32 [2, 24] and runs `moetrain score` (f32, not exact) on the step-3 checkpoint (with
#      --dtype bf16: on the export imported back by `moetrain convert --hf`, the same bf16-rounded weights);
#   4. loads the HF folder with AutoModelForCausalLM.from_pretrained(dtype=float32, attn_implementation="eager",
#      output_loading_info=True), runs the same ids and gathers log_softmax(logits)[b, t, id[b, t+1]];
#   5. compares: max abs diff and relative error ||hf - ours|| / ||hf|| of the [B, T-1] log-probs; the loader's
#      missing / unexpected / mismatched keys; the tensors save_pretrained writes back against the export (names
#      and bytes: every exported tensor reached the model, none was left at its random init); and the config the
#      export's config.json gives transformers against the one the source config.json gives (fields the writer
#      omitted that change a value are reported).
# Exits 1 if the relative error exceeds --tol (1e-5) or any key is missing, unexpected or mismatched, or the
# weights do not round-trip. Needs torch, safetensors and transformers 5.17 (e.g. /work/venv-golden/bin/python).
#
# Usage: python scripts/hf_export_check.py --moetrain build/src/moetrain \
#            --config tests/data/golden/deepseek_v2/config.json --workdir /tmp/hf_export_check/deepseek_v2
# The workdir is created if missing; its job.toml, ckpt/, hf/, in.safetensors and ours.safetensors are replaced.
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def run(cmd):
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.stdout.write(p.stdout)
        sys.exit(f"hf_export_check: command failed with exit status {p.returncode}")
    for line in p.stdout.splitlines():  # the engine's own lines, not the echoed resolved configuration
        if line.startswith("[moetrain"):
            print("  " + line)


def toml_str(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_config(path):
    with open(path) as f:
        d = json.load(f)
    return transformers.CONFIG_MAPPING[d["model_type"]].from_dict(d).to_dict()


def config_diff(source_json, export_json):
    ignore = {"transformers_version", "_name_or_path"}
    a, b = load_config(source_json), load_config(export_json)
    return [(k, a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(set(a) | set(b))
            if k not in ignore and a.get(k, "<unset>") != b.get(k, "<unset>")]


def main():
    ap = argparse.ArgumentParser(description="Train 3 steps, export to HF, and check that transformers reloads the export and gives moetrain score's log-probs (see the header of this file).")
    ap.add_argument("--moetrain", required=True, help="the moetrain binary")
    ap.add_argument("--config", required=True, help="HF config.json of the model family to check")
    ap.add_argument("--workdir", required=True, help="folder for the job, checkpoint, export and score files")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest relative error of the log-probs (1e-5)")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0, help="seed of the input ids")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                    help="the export's dtype; with bf16 moetrain scores the export imported back (convert --hf), so "
                         "both sides compute from the same bf16-rounded weights")
    args = ap.parse_args()

    if transformers.__version__.split(".")[:2] != ["5", "17"]:
        print(f"warning: transformers {transformers.__version__}, this check was written for 5.17")
    moetrain = os.path.abspath(args.moetrain)
    config = os.path.abspath(args.config)
    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    ckpt, hf = os.path.join(work, "ckpt"), os.path.join(work, "hf")
    reimported = os.path.join(work, "ckpt_from_hf")
    for d in (ckpt, hf, reimported):
        if os.path.isdir(d):
            shutil.rmtree(d)
    job = os.path.join(work, "job.toml")
    with open(job, "w") as f:
        f.write(f"""# written by scripts/hf_export_check.py
[model]
config = {toml_str(config)}
init = "random"
device = "cpu"

[data]
mode = "synthetic"

[train]
steps = 3
seq_len = 32
micro_batch = 2
global_batch = 4

[checkpoint]
dir = {toml_str(ckpt)}
every = 3

[metrics]
console_every = 1
""")

    # 1-2: train, export.
    run([moetrain, "train", "--config", job])
    run([moetrain, "convert", "--checkpoint", ckpt, "--out", hf, "--dtype", args.dtype])
    scored = ckpt
    if args.dtype == "bf16":
        run([moetrain, "convert", "--hf", hf, "--out", reimported])
        scored = reimported

    # 3: score with moetrain.
    with open(config) as f:
        vocab = json.load(f)["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.rows, args.tokens), generator=g, dtype=torch.int64)
    inp, ours_path = os.path.join(work, "in.safetensors"), os.path.join(work, "ours.safetensors")
    save_file({"input_ids": ids.to(torch.int32).contiguous()}, inp)
    run([moetrain, "score", "--config", job, "--input", inp, "--out", ours_path, f"--checkpoint.dir={scored}"])
    ours = load_file(ours_path)["logprobs"]
    if tuple(ours.shape) != (args.rows, args.tokens - 1):
        sys.exit(f"hf_export_check: logprobs has shape {tuple(ours.shape)}, expected {(args.rows, args.tokens - 1)}")

    # 4: transformers on the export.
    failures = []
    model, info = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    model.eval()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: loaded {type(model).__name__}")
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        got = sorted(map(str, info.get(what, [])))
        print(f"  {what}: {len(got)}" + (f" {got}" if got else ""))
        if got:
            failures.append(f"{len(got)} {what}")
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    ref = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]

    # 5: compare.
    diff = (ref - ours).abs()
    max_abs = diff.max().item()
    rel = (diff.norm() / ref.norm()).item()
    centred = ref - ref.mean()
    rel_centred = (diff.norm() / centred.norm()).item()
    print(f"log-probs [{args.rows}, {args.tokens - 1}]: max abs diff {max_abs:.3e}, relative error {rel:.3e} "
          f"(tolerance {args.tol:.0e}); against their spread around the mean ({centred.std().item():.3e}): "
          f"{rel_centred:.3e}")
    if not rel <= args.tol:
        failures.append(f"relative error {rel:.3e} > {args.tol:.0e}")

    # The loaded model written back in the checkpoint layout must be the export, name for name and byte for byte.
    exported = {}
    for name in sorted(os.listdir(hf)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(hf, name), "pt") as f:
                # A bf16 export loads into the f32 model exactly: compare in f32.
                exported.update({k: f.get_tensor(k).float() for k in f.keys()})
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = {}
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                saved.update(load_file(os.path.join(tmp, name)))
    only_export = sorted(set(exported) - set(saved))
    only_saved = sorted(set(saved) - set(exported))
    differ = sorted(k for k in set(exported) & set(saved)
                    if exported[k].dtype != saved[k].dtype or exported[k].shape != saved[k].shape
                    or not torch.equal(exported[k], saved[k]))
    print(f"weights: {len(exported)} exported tensors; save_pretrained after loading: {len(saved)}, "
          f"only in export {len(only_export)}, only in save {len(only_saved)}, different {len(differ)}")
    for label, keys in (("only in export", only_export), ("only in save", only_saved), ("different", differ)):
        if keys:
            print(f"  {label}: {keys[:10]}{' ...' if len(keys) > 10 else ''}")
            failures.append(f"{len(keys)} tensors {label}")

    # Config fields the writer left out are filled by transformers' defaults: report any that differ from the source.
    cdiff = config_diff(config, os.path.join(hf, "config.json"))
    print(f"config: {len(cdiff)} field(s) differ between the source config.json and the export's"
          + (" (not fatal; the log-probs above say whether they matter to the forward pass)" if cdiff else ""))
    for k, a, b in cdiff:
        print(f"  {k}: source {a!r}, export {b!r}")
    with open(config) as f:
        src_raw = json.load(f)
    with open(os.path.join(hf, "config.json")) as f:
        exp_raw = json.load(f)
    omitted = sorted(k for k in src_raw if k not in exp_raw)
    print(f"config.json: keys of the source absent from the export (transformers fills its defaults): {omitted}")

    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
