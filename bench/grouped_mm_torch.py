#!/usr/bin/env python3
# defines: the reference measurement for moetrain's grouped expert GEMMs: torch._grouped_mm (PyTorch's CUTLASS
# grouped kernel) on the Qwen3-30B-A3B and DeepSeek-V2-Lite expert shapes and the routings of CudaGroupedGemmBench.DISABLED_ExpertShapes
# (tests/ops/cuda_grouped_gemm_cutlass_test.cpp), printing TFLOP/s so the two can be compared in one run.
# Usage: python3 bench/grouped_mm_torch.py   (needs a CUDA GPU and PyTorch with torch._grouped_mm)
import inspect
import math
import sys

import torch

# (name, experts, rows, N, K): the workload of record's micro-batch and DeepSeek-V2-Lite's, as the C++ bench.
SHAPES = [
    ("gate_up (N=1536, K=2048)", 128, 65536, 1536, 2048),
    ("down (N=2048, K=768)", 128, 65536, 2048, 768),
    ("v2-lite gate_up (N=2816, K=2048)", 64, 24576, 2816, 2048),
    ("v2-lite down (N=2048, K=1408)", 64, 24576, 2048, 1408),
]
WARMUP, TIMED = 3, 20


def bench_sizes(skewed, experts, rows):
    """Rows per expert: uniform, or a Zipf-like share ~ 1 / (e + 1)^1.2 with the last 16 experts empty (as the C++)."""
    if not skewed:
        return [rows // experts] * experts
    active = experts - 16
    share = [1.0 / math.pow(e + 1.0, 1.2) if e < active else 0.0 for e in range(experts)]
    total = sum(share)
    sizes = [int(math.floor(rows * s / total)) for s in share]
    sizes[0] += rows - sum(sizes)
    return sizes


def time_ms(fn):
    for _ in range(WARMUP):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / TIMED


def main():
    if not torch.cuda.is_available():
        print("grouped_mm_torch: no CUDA device")
        return 1
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    try:
        print(f"torch._grouped_mm signature: {inspect.signature(torch._grouped_mm)}")
    except (TypeError, ValueError):
        print(f"torch._grouped_mm doc: {(torch._grouped_mm.__doc__ or '').strip()[:300]}")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print("torch._grouped_mm: bf16 in, bf16 out (f32 accumulate inside)")
    for name, experts, rows, n_out, n_in in SHAPES:
        print(f"  {name}: {experts} experts, {rows} rows")
        x = torch.randn(rows, n_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(experts, n_out, n_in, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(rows, n_out, device=dev, dtype=torch.bfloat16)
        for skewed in (False, True):
            sizes = bench_sizes(skewed, experts, rows)
            offs = torch.tensor(sizes, device=dev, dtype=torch.int64).cumsum(0).to(torch.int32)
            flops = 2.0 * rows * n_out * n_in
            ops = [
                # y [R, N] = x [R, K] w[g]^T
                ("fwd  ", lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
                # dx [R, K] = dy [R, N] w[g]
                ("dgrad", lambda: torch._grouped_mm(dy, w, offs=offs)),
                # dw [G, N, K] = dy_g^T x_g (bf16 out, overwritten: no f32 accumulation into an existing dw)
                ("wgrad", lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
            ]
            routing = f"skewed (Zipf 1.2, 16 empty, max {max(sizes)} rows)" if skewed else f"uniform ({max(sizes)} rows)"
            for op, fn in ops:
                try:
                    ms = time_ms(fn)
                    print(f"  {name:<26} {routing} {op} {ms:8.3f} ms {flops / (ms * 1e-3) / 1e12:7.1f} TFLOP/s")
                except Exception as e:  # report and go on: one unsupported case must not hide the others
                    print(f"  {name:<26} {routing} {op} FAILED: {type(e).__name__}: {str(e)[:200]}")
        # A spot check that the forward computes what the C++ op does (y = x w[g]^T per group).
        sizes = bench_sizes(True, experts, rows)
        offs = torch.tensor(sizes, device=dev, dtype=torch.int64).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        g, begin = 3, sum(sizes[:3])
        ref = (x[begin : begin + sizes[g]].float() @ w[g].float().t()).to(torch.bfloat16)
        err = (y[begin : begin + sizes[g]].float() - ref.float()).norm() / ref.float().norm()
        print(f"  {name:<26} forward spot check (group {g}): relative error {err.item():.2e}")
        del x, w, dy
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
