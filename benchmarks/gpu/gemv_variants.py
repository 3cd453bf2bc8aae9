"""The batch-1 GEMV of each Llama-3.1-8B projection in its plain, norm-fused (PRE_NORM) and residual-fused
(ADD_RES) forms, timed as the tuner times them (back to back in a CUDA graph, weights streamed from HBM), for
every M=1 config, with one tuple reduction per program and with one reduction per sum: does a fusion cost
bandwidth?

    python benchmarks/gpu/gemv_variants.py [--out gemv_variants.json]
"""
from __future__ import annotations

import argparse
import json

import torch

import radixlm.kernels.gemv as gemv_mod
from radixlm.kernels.gemv import CONFIGS, _launch, _time_calls

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, True),
          "down": (4096, 14336, False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for name, (n, k, fused) in SHAPES.items():
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        copies = [w] + [w.clone() for _ in range(min(7, -(-4 * l2 // (w.numel() * 2)) - 1))]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        res = torch.randn(1, n // 2 if fused else n, dtype=torch.bfloat16, device="cuda")
        for cfg in CONFIGS[1]:
            row = {"proj": name, "config": cfg}
            variants = {"plain": {}, "norm": {"norm_eps": 1e-5}}
            if not fused:
                variants["residual"] = {"residual": res}
            for joint in (True, False):  # one tuple reduction per program, or one reduction per sum
                gemv_mod.JOINT_REDUCE = joint
                for label, kw in variants.items():
                    if not joint and label == "residual":
                        continue
                    t = _time_calls([lambda c=c, kw=kw: _launch(x, c, None, fused, cfg, **kw) for c in copies])
                    row[label + ("_us" if joint else "_separate_us")] = round(t * 1e3, 2)
            gemv_mod.JOINT_REDUCE = True
            rows.append(row)
            print(row, flush=True)
        del copies
    best = {}
    for r in rows:
        b = best.setdefault(r["proj"], r)
        if r["plain_us"] < b["plain_us"]:
            best[r["proj"]] = r
    print("best plain config per projection:", {k: (v["config"], v) for k, v in best.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
