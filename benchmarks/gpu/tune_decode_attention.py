"""Sweep the decode attention kernel's launch settings on the GPU (8B shape: 32 query heads, 8 KV heads, head
size 128, bf16, page size 1 with KV slots scattered over the pool) and report time and bandwidth per setting,
beside the default. Usage: python benchmarks/gpu/tune_decode_attention.py --out tune.json"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from radixlm.kernels.decode_attention import decode_attention, decode_attention_ref, decode_num_splits

H, KVH, D = 32, 8, 128


def setup(bs: int, ctx: int, gen: torch.Generator):
    total = bs * ctx
    pool = total + 4096
    k = torch.randn(pool, KVH, D, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(pool, KVH, D, generator=gen).to("cuda", torch.bfloat16)
    slots = (torch.randperm(pool - 1, generator=gen)[:total] + 1).to(torch.int32).view(bs, ctx)
    r2t = torch.zeros(bs + 1, ctx + 8, dtype=torch.int32)
    r2t[1:, :ctx] = slots
    rows = torch.arange(1, bs + 1)
    q = torch.randn(bs, H, D, generator=gen).to("cuda", torch.bfloat16)
    lens = torch.full((bs,), ctx, dtype=torch.int32)
    return q, k, v, r2t.cuda(), rows.cuda(), lens.cuda()


def time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g = torch.cuda.CUDAGraph()  # replayed as the server replays it: no launch gaps between runs
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    results = []
    for bs in args.batch_sizes:
        q, k, v, r2t, rows, lens = setup(bs, args.context, gen)
        ref = decode_attention_ref(q[:2], k, v, r2t, rows[:2], lens[:2], D**-0.5)
        nbytes = bs * args.context * KVH * D * 2 * 2
        default_splits = decode_num_splits(bs, KVH, sms)
        split_choices = sorted(
            {max(1, min(16, math.ceil(w * sms / (bs * KVH)))) for w in (1, 2, 4, 8)} | {default_splits}
        )
        rows_out = []
        for splits, block_n, warps, stages in itertools.product(split_choices, (32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
            out = torch.empty_like(q)
            fn = lambda: decode_attention(  # noqa: E731
                q,
                k,
                v,
                r2t,
                rows,
                lens,
                D**-0.5,
                splits,
                out=out,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
            )
            try:
                us = time_us(fn)
            except Exception as e:  # a setting this GPU cannot run (shared memory)
                print(f"bs {bs} splits {splits} block_n {block_n} warps {warps} stages {stages}: {type(e).__name__}")
                continue
            err = ((out[:2].float() - ref.float()).norm() / ref.float().norm()).item()
            rows_out.append(
                {
                    "batch": bs,
                    "splits": splits,
                    "block_n": block_n,
                    "warps": warps,
                    "stages": stages,
                    "us": us,
                    "tb_per_s": nbytes / us / 1e6,
                    "rel_err": err,
                    "default": (splits, block_n, warps, stages) == (default_splits, 64, 4, 2),
                }
            )
        rows_out.sort(key=lambda r: r["us"])
        default = next(r for r in rows_out if r["default"])
        print(f"batch {bs} ctx {args.context}: default {default['us']:.1f} us ({default['tb_per_s']:.2f} TB/s)")
        for r in rows_out[:6]:
            print(
                f"   splits {r['splits']:2d} block_n {r['block_n']:3d} warps {r['warps']} stages {r['stages']}: "
                f"{r['us']:7.1f} us {r['tb_per_s']:.2f} TB/s err {r['rel_err']:.1e}"
            )
        results += rows_out
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "context": args.context, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
