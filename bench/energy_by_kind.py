# defines: the joules a TFLOP (or a GB) of each kind of work in a benchmark's step, at the GPU's power limit, through
# PyTorch's kernels on random operands at the step's shapes, each held for ~1.5 s: dense GEMM (the head's forward),
# grouped GEMM (the experts' gate_up forward), cuDNN causal attention forward and forward + backward, an HBM copy, and
# the idle power after them. A step at the limit is as fast as its joules allow, so these rates, weighted by the step's
# FLOPs and the bytes it cannot avoid moving, give the least energy a step can take and so the most tokens/s the limit
# allows (docs/gpu_notes.md, twenty-fifth and thirty-eighth sessions).
#   python3 bench/energy_by_kind.py [--job workload_of_record|deepseek_v2_lite] [--baseline TOKENS_PER_S | JSON]
#   python3 bench/energy_by_kind.py --job deepseek_v2_lite --rates dense=1.05,grouped=1.23,attention=1.65,hbm=0.145
# (--rates: no GPU needed; the floor from given joules a TFLOP / GB.) --moetrain BENCH_JSON (`moetrain bench --out`'s
# file for the same job) adds moetrain's own rates in its step, each op family's time at the step's mean power (a
# lower bound: memory-bound ops draw less than the mean, so the GEMMs and attention draw more), and takes the lower
# rate of each kind for the floor; it also states how far that run's joules are above the floor, op family by op
# family (each family's time at the run's mean power beside its share of the floor).
import argparse, json, os, time, tomllib

BENCH = os.path.dirname(os.path.abspath(__file__))
# Each benchmark's job file: its step (train.seq_len, train.micro_batch and train.global_batch in sequences) and its
# model (model.config, relative to the job file) are read from there, as `moetrain bench --config` reads them.
JOBS = {"workload_of_record": "workload_of_record.toml", "deepseek_v2_lite": "deepseek_v2_lite/job.toml"}


def step_shapes(job):
    """The step's FLOPs by kind of work and the bytes outside the GEMMs that no implementation of its recipe avoids
    (bf16 compute, fp32 masters, bf16 AdamW moments, f32 gradients, materialised bf16 logits), from the job file and
    its config.json."""
    job_path = os.path.join(BENCH, JOBS[job])
    with open(job_path, "rb") as f:
        spec = tomllib.load(f)
    train = spec["train"]
    seq, seqs, batch = train["seq_len"], train["micro_batch"], train["global_batch"]
    if batch % seqs:
        raise SystemExit(f"energy_by_kind: {job_path}: train.global_batch ({batch}) is not a multiple of "
                         f"train.micro_batch ({seqs})")
    micro = batch // seqs
    c = json.load(open(os.path.join(os.path.dirname(job_path), spec["model"]["config"])))
    tokens = seq * seqs * micro
    h, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    if c["model_type"] == "deepseek_v2":
        d_qk, d_v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
        q_in = c["q_lora_rank"] or h
        attention = (h * c["q_lora_rank"] if c["q_lora_rank"] else 0) + q_in * heads * d_qk
        attention += h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        attention += c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + d_v) + heads * d_v * h
        experts, top_k, width = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        dense_layers = c["first_k_dense_replace"]
        shared = c["n_shared_experts"] * 3 * h * width
    else:
        d_qk = d_v = c["head_dim"]
        attention = h * heads * d_qk + 2 * h * c["num_key_value_heads"] * d_qk + heads * d_v * h
        experts, top_k, width = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
        dense_layers, shared = len(c.get("mlp_only_layers", [])), 0
    moe_layers = layers - dense_layers
    dense_params = v * h  # the head (the embedding's gradient is a scatter, not a GEMM)
    dense_params += layers * attention + dense_layers * 3 * h * c["intermediate_size"]
    dense_params += moe_layers * (shared + h * experts)
    active_expert_params = moe_layers * top_k * 3 * h * width
    params = v * h + dense_params + moe_layers * experts * 3 * h * width  # the embedding, the rest, the experts
    # Causal: half of 2 * S^2 * d for each of QK^T and PV. Forward + backward is 3.5 forwards (the backward recomputes
    # the scores), as the attention rates below count it; moetrain's MFU counts 3, so its FLOPs a token are ~2% fewer.
    attention_forward = layers * micro * seqs * heads * seq * seq * (d_qk + d_v)
    logits = tokens * v * 2
    return dict(
        tokens=tokens,
        params=params,
        tflop=dict(dense=6 * tokens * dense_params / 1e12, grouped=6 * tokens * active_expert_params / 1e12,
                   attention=3.5 * attention_forward / 1e12),
        # The optimizer's 22 bytes a parameter (f32 gradient read, f32 master read and written, two bf16 moments read
        # and written, the bf16 weight written) and the loss's two passes over the logits (read, their gradient
        # written). What a GEMM reads and writes itself (the logits' write and the head's reads of their gradient, the
        # f32 weight gradients' writes) is in its joules a TFLOP: the rates below are measured on GEMMs that move
        # their operands and outputs through HBM as the step's do.
        gb_parts=dict(optimizer=params * 22 / 1e9, loss=2 * logits / 1e9),
        micro_tokens=seq * seqs, h=h, v=v, experts=experts, top_k=top_k, width=width, heads=heads, d_qk=d_qk,
        d_v=d_v, seq=seq, seqs=seqs, handoffs=hopper_handoffs(h, top_k, width, layers, moe_layers))


def hopper_handoffs(h, k, i, layers, moe_layers):
    """The activations' passes through HBM that a step's decoder layers make on Hopper outside their GEMMs and
    attention (whose own reads and writes are in their joules a TFLOP), a token's worth: (tensor and the passes that
    move it, elements, passes, whether it is an expert row gathered from or scattered to token order, the layers that
    have it). A lower bound, on these assumptions:
    - every elementwise or row-wise op (norms, rope, q/k norm, SwiGLU and its backward, residual adds, the routing
      weights) is free, fused into a GEMM's epilogue or into another pass, reading only what that pass does not
      already read (a residual, the SwiGLU input its backward needs);
    - every tensor a GEMM or attention reads is in HBM, and so is what a GEMM writes: a GEMM's tile reads whole rows
      along its reduction, which the producer's tiles make in pieces, so two GEMMs do not fuse;
    - the expert GEMMs' rows are gathered from token order, and their outputs summed back to it, by passes of their
      own: Hopper's TMA cannot gather rows, a GEMM fed by cp.async runs 1.4-1.5x slower (CUTLASS example 52,
      docs/gpu_notes.md, thirty-eighth session), and a token's K expert outputs come from K tiles;
    - what the backward reads of the forward is kept, not recomputed (a GEMM again costs more than its bytes).
    Only the residual stream's and the routed experts' passes are counted: DeepSeek-V2's latent attention (the key's
    assembly and its rope part), its shared experts and the dense layers' MLPs have passes of their own that are left
    out, which keeps it a lower bound. h: the hidden size, k: the experts a token, i: an expert's width; the layers'
    count and how many of them are MoE layers, as step_shapes counts them for the FLOPs."""
    return [
        # forward
        ("layer input: written by the sum to token order; the residual in o_proj's epilogue and in the norm's "
         "backward", h, 3, False, layers),
        ("attention block output: the gather, the residual in the sum to token order and in the norm's backward", h, 3,
         False, layers),
        ("expert input rows: written by the gather", k * h, 1, True, moe_layers),
        ("gate_up: read by SwiGLU's backward in the down input gradient's epilogue", k * 2 * i, 1, False, moe_layers),
        ("SwiGLU output: written in gate_up's epilogue, read for the routing weight's gradient", k * i, 2, False,
         moe_layers),
        ("expert output rows: read by the sum to token order", k * h, 1, True, moe_layers),
        # backward
        ("layer output gradient: the gather into the down rows, the residual in the norm's backward", h, 2, False,
         layers),
        ("down output gradient rows: written by the gather", k * h, 1, True, moe_layers),
        ("expert input gradient rows: read by the sum to token order", k * h, 1, True, moe_layers),
        ("attention block output gradient: written by the sum to token order, the residual in the qkv input "
         "gradient's epilogue", h, 2, False, layers),
    ]


def measure_rates(s):
    import torch, torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel, SDPBackend
    from gpu_energy import gpu_energy_j
    dev, rates = "cuda", {}

    def measure(kind, name, fn, work, unit):
        for _ in range(3): fn()
        torch.cuda.synchronize(); t0 = time.time(); n = 0
        while time.time() - t0 < 0.3: fn(); n += 1
        torch.cuda.synchronize(); per = (time.time() - t0) / n; calls = max(10, int(1.5 / per))
        torch.cuda.synchronize(); j0 = gpu_energy_j(); t0 = time.time()
        for _ in range(calls): fn()
        torch.cuda.synchronize(); t = (time.time() - t0) / calls; j1 = gpu_energy_j()
        if j0 is None or j1 is None: raise SystemExit("energy_by_kind: NVML's energy counter cannot be read here")
        j = (j1 - j0) / calls
        print(f"{name:40s} {t*1e3:8.3f} ms {work/t:8.1f} {unit}/s {j/t:6.0f} W {j/work:7.3f} J/{unit}", flush=True)
        rates[kind] = j / work

    m, h, v = s["micro_tokens"], s["h"], s["v"]
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16); w = torch.randn(v, h, device=dev, dtype=torch.bfloat16)
    measure("dense", "dense gemm, head forward", lambda: x @ w.t(), 2 * m * h * v / 1e12, "TFLOP")
    del x, w
    e, rows, n = s["experts"], m * s["top_k"], 2 * s["width"]
    a = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
    wt = torch.randn(e, h, n, device=dev, dtype=torch.bfloat16)
    offs = torch.cumsum(torch.full((e,), rows // e, dtype=torch.int32), 0).to(torch.int32).to(dev)
    measure("grouped", "grouped gemm, gate_up forward", lambda: torch._grouped_mm(a, wt, offs=offs),
            2 * rows * h * n / 1e12, "TFLOP")
    del a, wt
    # The same two GEMMs in FP8 (e4m3, row-wise scales), for what FP8 GEMMs would make of the floor; not the recipe.
    f8 = torch.float8_e4m3fn
    try:
        x8 = torch.randn(m, h, device=dev).to(f8); w8 = torch.randn(v, h, device=dev).to(f8)
        sx, sw = torch.ones(m, 1, device=dev), torch.ones(1, v, device=dev)
        measure("dense_fp8", "dense gemm, head forward, fp8",
                lambda: torch._scaled_mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16), 2 * m * h * v / 1e12, "TFLOP")
        del x8, w8
        a8 = torch.randn(rows, h, device=dev).to(f8); w8 = torch.randn(e, n, h, device=dev).to(f8)
        sa, sb = torch.ones(rows, device=dev), torch.ones(e, n, device=dev)
        measure("grouped_fp8", "grouped gemm, gate_up forward, fp8",
                lambda: torch._scaled_grouped_mm(a8, w8.transpose(-2, -1), sa, sb, offs=offs,
                                                 out_dtype=torch.bfloat16), 2 * rows * h * n / 1e12, "TFLOP")
        del a8, w8
    except (RuntimeError, AttributeError) as ex:
        print(f"fp8 gemms: not run here ({str(ex)[:100]})")
    b, hd, sq = s["seqs"], s["heads"], s["seq"]
    q = torch.randn(b, hd, sq, s["d_qk"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hd, sq, s["d_qk"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    vv = torch.randn(b, hd, sq, s["d_v"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(b, hd, sq, s["d_v"], device=dev, dtype=torch.bfloat16)
    fl = b * hd * sq * sq * (s["d_qk"] + s["d_v"]) / 1e12
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                f = lambda: F.scaled_dot_product_attention(q, k, vv, is_causal=True)
                measure("attention_forward", f"{backend.name.lower()} attention forward", f, fl, "TFLOP")
                measure("attention", f"{backend.name.lower()} attention forward+backward", lambda: f().backward(go),
                        3.5 * fl, "TFLOP")
            break
        except RuntimeError as ex:
            print(f"{backend.name.lower()} attention: not run here ({str(ex)[:100]})")
    del q, k, vv, go
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev); b2 = torch.empty_like(a)
    measure("hbm", "hbm copy (read + write)", lambda: b2.copy_(a), 2 * a.numel() / 1e9, "GB")
    idle0 = gpu_energy_j(); time.sleep(1.0); print(f"{'idle':40s} {gpu_energy_j() - idle0:6.0f} W")
    return rates


def power_limit_w():
    import ctypes, torch
    nvml = ctypes.CDLL("libnvidia-ml.so.1"); nvml.nvmlInit_v2()
    p = torch.cuda.get_device_properties("cuda")
    bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0".encode()
    handle, milliwatts = ctypes.c_void_p(), ctypes.c_uint()
    nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle))
    if nvml.nvmlDeviceGetEnforcedPowerLimit(handle, ctypes.byref(milliwatts)): return None
    return milliwatts.value / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", choices=sorted(JOBS), default="workload_of_record")
    ap.add_argument("--rates", help="kind=J_per_TFLOP_or_GB,... (dense, grouped, attention, hbm; dense_fp8 and "
                    "grouped_fp8 for the FP8 floor): no GPU needed")
    ap.add_argument("--limit-w", type=float, default=700.0, help="the power limit with --rates (700 W: H100, H200)")
    ap.add_argument("--baseline", help="a baseline's tokens/s, or bench/torch_baseline.py's JSON (its compiled run's), "
                    "to state the floor as a ratio to it")
    ap.add_argument("--moetrain", help="moetrain bench's JSON for this job: its own rates in the step")
    args = ap.parse_args()
    s = step_shapes(args.job)
    if args.baseline is not None:
        args.baseline = (json.load(open(args.baseline))["compiled_tok_s"] if os.path.isfile(args.baseline)
                         else float(args.baseline))
    if args.rates:
        rates = {}
        for pair in args.rates.split(","):
            kind, _, value = pair.partition("=")
            try:
                rates[kind.strip()] = float(value)
            except ValueError:
                raise SystemExit(f"energy_by_kind: --rates expects kind=number pairs, found {pair!r}")
        limit = args.limit_w
    else:
        rates = measure_rates(s)
        limit = power_limit_w() or args.limit_w
    run = None
    if args.moetrain:
        run = json.load(open(args.moetrain))
        if "energy" not in run:
            raise SystemExit(f"energy_by_kind: {args.moetrain} has no energy (a GPU run whose counter advanced is "
                             f"needed): {run.get('energy_not_measured', 'not a GPU run')}")
        if run["tokens_per_step"] != s["tokens"]:
            raise SystemExit(f"energy_by_kind: {args.moetrain} ran {run['tokens_per_step']:.0f} tokens a step, "
                             f"but {args.job} takes {s['tokens']}")
        watts, times = run["energy"]["mean_power_W"], run.get("time_per_step_s", {})
        missing = {"gemm", "grouped_gemm", "attention"} - set(times)
        if missing:
            raise SystemExit(f"energy_by_kind: {args.moetrain} has no time a step for {sorted(missing)} "
                             f"(time_per_step_s holds {sorted(times)})")
        for kind, family in (("dense", "gemm"), ("grouped", "grouped_gemm"), ("attention", "attention")):
            own = times[family] * watts / s["tflop"][kind]
            print(f"moetrain's {family} in its step: {1e3 * times[family]:.1f} ms at {watts:.0f} W, "
                  f"{own:.3f} J/TFLOP" + (" (the lower rate, taken)" if own < rates.get(kind, float("inf")) else ""))
            rates[kind] = min(own, rates.get(kind, float("inf")))
    missing = {"dense", "grouped", "attention", "hbm"} - set(rates)
    if missing: raise SystemExit(f"energy_by_kind: no rate for {sorted(missing)}")
    parts = {kind: s["tflop"][kind] * rates[kind] for kind in ("dense", "grouped", "attention")}
    parts["bytes"] = sum(s["gb_parts"].values()) * rates["hbm"]
    floor = sum(parts.values())
    print(f"{args.job}: {s['tokens']} tokens a step, {s['params'] / 1e9:.3f}B parameters; TFLOP a step: "
          + ", ".join(f"{k} {x:.2f}" for k, x in s["tflop"].items())
          + f"; unavoidable bytes {sum(s['gb_parts'].values()):.1f} GB")
    print(f"floor: {floor:.1f} J a step (" + ", ".join(f"{k} {x:.1f}" for k, x in parts.items())
          + f"), with every other op free: at {limit:.0f} W a step of at least {1e3 * floor / limit:.1f} ms, at most "
          f"{s['tokens'] * limit / floor:,.0f} tokens/s"
          + (f" = {s['tokens'] * limit / floor / args.baseline:.2f}x the baseline's {args.baseline:,.0f}"
             if args.baseline else ""))
    # bf16 activations, 2 bytes an element; split into the expert rows' gathers and scatters and the rest.
    gb = {rows: 2 * s["tokens"] * sum(n * a * l for _, n, a, r, l in s["handoffs"] if r == rows) / 1e9
          for rows in (True, False)}
    with_all, without_rows = floor + (gb[True] + gb[False]) * rates["hbm"], floor + gb[False] * rates["hbm"]
    ratio = lambda j: (f" = {s['tokens'] * limit / j / args.baseline:.2f}x the baseline" if args.baseline else "")
    print(f"the activations' passes outside the GEMMs and attention on Hopper, at the least (hopper_handoffs): "
          f"{gb[False]:.1f} GB, and {gb[True]:.1f} GB for the expert rows' gathers and sums")
    print(f"floor with them: {with_all:.1f} J a step, at most {s['tokens'] * limit / with_all:,.0f} tokens/s"
          + ratio(with_all) + f"; with the rows' gathers free: {without_rows:.1f} J, at most "
          f"{s['tokens'] * limit / without_rows:,.0f} tokens/s" + ratio(without_rows))
    if "dense_fp8" in rates and "grouped_fp8" in rates:
        # Each GEMM kind in FP8 only where FP8 measured cheaper (torch's FP8 grouped kernel is slow at some shapes).
        fp8 = floor + sum(s["tflop"][k] * min(0.0, rates[k + "_fp8"] - rates[k]) for k in ("dense", "grouped"))
        print(f"floor with FP8 dense and expert GEMMs where the rates above make them cheaper (attention in bf16; "
              f"every op outside the GEMMs free, the FP8 quantizations too): "
              f"{fp8:.1f} J a step, at most {s['tokens'] * limit / fp8:,.0f} tokens/s"
              + (f" = {s['tokens'] * limit / fp8 / args.baseline:.2f}x the baseline" if args.baseline else ""))
    if run:
        joules = run["energy"]["joules_per_step"]
        print(f"moetrain's run: {joules:.1f} J a step, {run['tokens_per_s']:,.0f} tokens/s: {joules - floor:.1f} J "
              f"({100 * (joules / floor - 1):.0f}%) above the floor"
              + f", {joules - with_all:.1f} J ({100 * (joules / with_all - 1):.0f}%) above the one with the passes "
              f"Hopper cannot fuse")
        # Where the joules above the floor are: each op family's time at the run's mean power beside the floor's share
        # of it. GEMMs draw more than the mean and memory-bound ops less, so this puts too much on the latter.
        floor_of = {"gemm": parts["dense"], "grouped_gemm": parts["grouped"], "attention": parts["attention"],
                    "optimizer": s["gb_parts"]["optimizer"] * rates["hbm"],
                    "loss": s["gb_parts"]["loss"] * rates["hbm"],
                    "expert rows": gb[True] * rates["hbm"], "other memory-bound": gb[False] * rates["hbm"],
                    "other": 0.0}
        spent = dict.fromkeys(floor_of, 0.0)
        for family, seconds in run["time_per_step_s"].items():
            group = (family if family in floor_of else "expert rows" if family in ("permute", "row_gather")
                     else "other memory-bound")
            spent[group] += seconds * watts
        print(f"{'op families':20s} {'moetrain J':>11s} {'floor J':>8s} {'above':>7s}  (other: host work and gaps)")
        for group in floor_of:
            print(f"{group:20s} {spent[group]:11.1f} {floor_of[group]:8.1f} {spent[group] - floor_of[group]:7.1f}")


if __name__ == "__main__":
    main()
