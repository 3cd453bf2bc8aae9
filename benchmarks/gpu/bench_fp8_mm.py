"""The skinny FP8 matmul candidates one by one, per Llama projection shape and batch: the bf16 weight's best
(cuBLAS or our GEMV), the scaled GEMM (x quantized per token + torch._scaled_mm) and every tensor-core config
of `kernels/fp8_mm.py` (W8A8, x quantized by the same per-token kernel). Each time is one call streaming its
weights from HBM (copies together 4x L2, calls back to back in a CUDA graph), with the weight-read rate beside
it, so the table says how far each kernel is from the HBM floor.

    python benchmarks/gpu/bench_fp8_mm.py --shapes 8b 70b --batches 1 8 16 32 128 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import radixlm  # noqa: E402,F401  (before torch, as users import it)
from radixlm.kernels import gemv as G  # noqa: E402
from radixlm.kernels.fp8_mm import CONFIGS as MMA_CONFIGS  # noqa: E402
from radixlm.kernels.fp8_mm import bucket, fp8_mm  # noqa: E402
from radixlm.srt.layers.quantization.fp8 import quantize_rows  # noqa: E402

SHAPES = {  # name -> [(projection, N, K, fused gate_up + silu)]
    "8b": [("qkv", 6144, 4096, False), ("o", 4096, 4096, False), ("gate_up", 28672, 4096, True),
           ("down", 4096, 14336, False), ("head", 128256, 4096, False)],
    "70b": [("qkv", 10240, 8192, False), ("o", 8192, 8192, False), ("gate_up", 57344, 8192, True),
            ("down", 8192, 28672, False), ("head", 128256, 8192, False)],
}  # fmt: skip


def timed(fn_per_copy, copies) -> float | None:
    try:
        return G._time_calls([lambda c=c: fn_per_copy(c) for c in copies]) * 1e3  # us
    except Exception as e:  # noqa: BLE001 - a config the compiler cannot build on this GPU
        print(f"    failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def copies_of(w: torch.Tensor) -> list[torch.Tensor]:
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    return [w] + [w.clone() for _ in range(min(7, -(-4 * l2 // (w.numel() * w.element_size())) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 128])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        for proj, n, k, fused in SHAPES[shape]:
            w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            wq, ws = quantize_rows(w16)
            ws = ws.reshape(-1)
            c16, c8 = copies_of(w16), copies_of(wq)
            for m in args.batches:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                r = {"shape": shape, "proj": proj, "N": n, "K": k, "fused": fused, "M": m}
                lib16 = G.gemv_silu_mul_ref if fused else G.gemv_ref
                r["bf16_cublas_us"] = timed(lambda c: lib16(x, c), c16)
                if m <= G.MAX_M:
                    best = min(
                        (t, cfg)
                        for cfg in G.CONFIGS[G._block_m(m)]
                        if (t := timed(lambda c, cfg=cfg: G._launch(x, c, None, fused, cfg), c16)) is not None
                    )
                    r["bf16_gemv_us"], r["bf16_gemv_cfg"] = best
                scaled = (
                    (lambda c: G._silu_mul(G.scaled_mm_ref(x, c, ws)))
                    if fused
                    else (lambda c: G.scaled_mm_ref(x, c, ws))
                )
                r["fp8_scaled_mm_us"] = timed(scaled, c8)
                mma = {}
                for cfg in MMA_CONFIGS[bucket(m)]:
                    mma[str(cfg)] = timed(lambda c, cfg=cfg: fp8_mm(x, c, ws, None, cfg, fused), c8)
                r["fp8_mma_us"] = mma
                ok = {c: t for c, t in mma.items() if t is not None}
                r["fp8_mma_best"] = min(ok.items(), key=lambda kv: kv[1]) if ok else None
                # the best config per way of loading tiles (the 6th field; 5 fields: pointer loads)
                by_loads: dict[int, float] = {}
                for cfg in MMA_CONFIGS[bucket(m)]:
                    t, loads = mma[str(cfg)], cfg[5] if len(cfg) > 5 else 0
                    if t is not None and t < by_loads.get(loads, float("inf")):
                        by_loads[loads] = t
                r["fp8_mma_best_by_loads"] = by_loads
                ref = G._silu_mul(G.scaled_mm_ref(x, wq, ws)) if fused else G.scaled_mm_ref(x, wq, ws)
                if ok:
                    best_cfg = eval(r["fp8_mma_best"][0])
                    got = fp8_mm(x, wq, ws, None, best_cfg, fused)
                    r["fp8_mma_rel_err_vs_scaled_mm"] = G._rel_err(got, ref)
                    # the same config with the MMA's truncating accumulator over all of K (no float32 promotion)
                    got = fp8_mm(x, wq, ws, None, best_cfg, fused, precise=False)
                    r["fp8_mma_imprecise_rel_err_vs_scaled_mm"] = G._rel_err(got, ref)
                    r["fp8_mma_imprecise_us"] = timed(
                        lambda c: fp8_mm(x, c, ws, None, best_cfg, fused, precise=False), c8
                    )
                fp8_best = min(
                    t for t in (r["fp8_scaled_mm_us"], r["fp8_mma_best"][1] if ok else None) if t is not None
                )
                bf16_best = min(t for t in (r["bf16_cublas_us"], r.get("bf16_gemv_us")) if t is not None)
                r["fp8_best_us"], r["bf16_best_us"] = fp8_best, bf16_best
                r["fp8_GBps"] = wq.numel() / fp8_best / 1e3
                r["bf16_GBps"] = 2 * w16.numel() / bf16_best / 1e3
                rows.append(r)
                print(
                    f"{shape} {proj:8s} M={m:4d}  bf16 {bf16_best:7.1f} us ({r['bf16_GBps']:5.0f} GB/s)  fp8: scaled "
                    f"{r['fp8_scaled_mm_us'] or 0:7.1f}  mma "
                    f"{r['fp8_mma_best'][1] if ok else 0:7.1f} {r['fp8_mma_best'][0] if ok else ''}"
                    f"  best {fp8_best:7.1f}"
                    f" us ({r['fp8_GBps']:5.0f} GB/s, {bf16_best / fp8_best:.2f}x)  by loads (pointer/tma) "
                    + "/".join(f"{by_loads[i]:.1f}" if i in by_loads else "-" for i in range(2))
                    + (
                        f"  imprecise acc {r['fp8_mma_imprecise_us'] or 0:.1f} us, err vs scaled GEMM"
                        f" {r['fp8_mma_rel_err_vs_scaled_mm']:.1e}"
                        f" (imprecise {r['fp8_mma_imprecise_rel_err_vs_scaled_mm']:.1e})"
                        if ok
                        else ""
                    ),
                    flush=True,
                )
            del c16, c8, w16, wq
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name().replace(" ", "_")
        (args.out / "fp8_mm.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
