"""Prefill-sized FP8 GEMMs on one GPU: how much of a prefill step's matmul time the scaling mode costs.

For the projections of a Llama shape's shard (default: 70B at tp 2) and M prompt tokens, times
  bf16       F.linear on bf16 weights (the anchor)
  rowwise    per-token activation quantization + torch._scaled_mm with row-wise scales (what radixlm runs)
  tensorwise per-tensor scales (one amax over x) + torch._scaled_mm, then the per-channel weight scale applied
             to the output (what a per-tensor GEMM would cost us with our per-channel checkpoints)
each as the median of CUDA-event-timed repeats, and prints ms and TFLOP/s.

Usage: python tools/fp8_prefill_gemm.py [--tp 2] [--m 1024 4096 8192]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from radixlm.kernels.fp8_quant import quantize_tokens

E4M3_MAX = 448.0


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, tp: int) -> dict[str, tuple[int, int]]:
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim // tp, hidden),
        "o": (hidden, heads * head_dim // tp),
        "gate_up": (2 * inter // tp, hidden),
        "down": (hidden, inter // tp),
    }


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[1024, 4096, 8192])
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__)
    print(f"{'proj':>8} {'M':>6} | {'bf16 ms':>8} {'rowwise ms':>10} {'tensorwise ms':>13} | TFLOP/s bf16 row tensor")
    for name, (n, k) in shapes(8192, 28672, 64, 8, 128, args.tp).items():
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        wq, ws = quantize_tokens(w16)  # per output channel
        ws_row = ws.reshape(1, -1).float()
        one = torch.ones((), device=dev)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

            def rowwise():
                xq, xs = quantize_tokens(x)
                return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_row, out_dtype=torch.bfloat16)

            def tensorwise():
                s = x.abs().amax().float().clamp_min(1e-12) / E4M3_MAX
                xq = (x / s).to(torch.float8_e4m3fn)
                y = torch._scaled_mm(xq, wq.t(), scale_a=s, scale_b=one, out_dtype=torch.bfloat16)
                return y.mul_(ws_row.to(torch.bfloat16))

            t16 = timed(lambda: F.linear(x, w16))
            tr = timed(rowwise)
            tt = timed(tensorwise)
            fl = 2 * m * n * k / 1e9
            rates = f"{fl / t16:7.0f} {fl / tr:4.0f} {fl / tt:6.0f}"
            print(f"{name:>8} {m:>6} | {t16:8.3f} {tr:10.3f} {tt:13.3f} | {rates}")


if __name__ == "__main__":
    main()
