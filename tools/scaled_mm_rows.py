"""Investigation (issue 30): does the scaled GEMM's time follow the batch rows smoothly inside a tuner bucket?
The skinny-matmul tuner times `torch._scaled_mm` once per bucket, at the bucket's top (64, 128, 256 rows), and the
runtime then calls it at every batch size inside. This times it, per 70B projection, at rows across each bucket
as called and with the rows padded to the bucket's top (zeros; the output sliced back), weights streamed from HBM
(distinct copies, 4x the L2), in CUDA graphs.

    python tools/scaled_mm_rows.py --out DIR/scaled_mm_rows.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {
    "qkv": (10240, 8192),
    "o": (8192, 8192),
    "gate_up": (57344, 8192),
    "down": (8192, 28672),
    "head": (128256, 8192),
}
E4M3 = torch.float8_e4m3fn


def time_graph(fn, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[33, 48, 64, 65, 80, 96, 112, 128, 129, 144, 160, 176, 192, 208, 224, 240, 256],
    )
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, min(8, -(-4 * l2 // (n * k))))
        ws = [torch.randn(n, k, device="cuda").to(E4M3) for _ in range(copies)]
        sb = torch.rand(1, n, device="cuda") + 0.5
        for m in args.rows:
            top = 64 if m <= 64 else 128 if m <= 128 else 256
            x = torch.randn(m, k, device="cuda").to(E4M3)
            sa = torch.rand(m, 1, device="cuda") + 0.5
            xp = torch.zeros(top, k, device="cuda", dtype=E4M3)
            sp = torch.ones(top, 1, device="cuda")

            def raw():
                for w in ws:
                    torch._scaled_mm(x, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

            def padded():
                for w in ws:
                    xp[:m].copy_(x)
                    sp[:m].copy_(sa)
                    torch._scaled_mm(xp, w.t(), scale_a=sp, scale_b=sb, out_dtype=torch.bfloat16)[:m]

            t_raw, t_pad = time_graph(raw) / copies, time_graph(padded) / copies
            rows_out.append(
                {"shape": name, "N": n, "K": k, "M": m, "bucket_top": top, "raw_us": t_raw, "padded_us": t_pad}
            )
            print(
                f"{name:8s} M={m:4d} (bucket {top:3d}) raw {t_raw:7.1f} us  padded {t_pad:7.1f} us"
                f"  {t_raw / t_pad:5.2f}x",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
