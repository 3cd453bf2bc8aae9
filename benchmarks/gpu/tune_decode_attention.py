"""Sweep the decode attention kernel's launch settings on the GPU and report time and bandwidth per setting,
beside the default (page size 1, KV slots scattered over the pool). Shapes: --heads/--kv-heads (8B: 32/8, 70B:
64/8), head size 128; --kv-dtype e4m3 also sweeps the float16 dots (`f16_dot`); a one-split setting is timed
with its output written by stage 1 (`direct`) and with the merge; with the float16 dots, V widened before the
dot's layout change (`v_staged`) and not.
Usage: python benchmarks/gpu/tune_decode_attention.py --batch-sizes 64 160 --context 1500 --heads 64 \
    --kv-dtype e4m3 --out tune.json"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from radixlm.kernels.decode_attention import decode_attention, decode_attention_ref
from radixlm.kernels.decode_launch import decode_num_splits

D = 128


def setup(bs: int, ctx: int, h: int, kvh: int, kv_dtype: torch.dtype, gen: torch.Generator):
    total = bs * ctx
    pool = total + 4096
    dev_gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
    k = torch.randn(pool, kvh, D, generator=dev_gen, device="cuda").to(kv_dtype)
    v = torch.randn(pool, kvh, D, generator=dev_gen, device="cuda").to(kv_dtype)
    slots = (torch.randperm(pool - 1, generator=gen)[:total] + 1).to(torch.int32).view(bs, ctx)
    r2t = torch.zeros(bs + 1, ctx + 8, dtype=torch.int32)
    r2t[1:, :ctx] = slots
    rows = torch.arange(1, bs + 1)
    q = torch.randn(bs, h, D, generator=gen).to("cuda", torch.bfloat16)
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


def settings(
    bs: int, kvh: int, sms: int, fp8: bool, block_ns=(32, 64, 128), warps_list=(4, 8), stages_list=(2, 3, 4),
    default_splits_only: bool = False, f16_only: bool = False,
):  # fmt: skip
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    default = decode_num_splits(bs, kvh, sms, kv_dtype)
    splits = sorted({max(1, min(16, math.ceil(w * sms / (bs * kvh)))) for w in (1, 2, 4, 8)} | {default})
    if default_splits_only:
        splits = [default]
    for s, block_n, warps, stages, f16 in itertools.product(
        splits, block_ns, warps_list, stages_list, (True,) if fp8 and f16_only else (True, False) if fp8 else (False,)
    ):
        directs = (True, False) if s == 1 else (False,)
        for direct, staged in itertools.product(directs, (True, False) if f16 else (False,)):
            yield {"splits": s, "block_n": block_n, "warps": warps, "stages": stages, "f16_dot": f16, "direct": direct,
                   "v_staged": staged}  # fmt: skip


def beside_gemm(fn, bs: int, gen: torch.Generator) -> tuple[float, float]:
    """The default launch timed alone and between FP8 GEMMs of a 70B down projection at `bs` rows (the step's
    neighbours: the clocks and caches a served step gives it), as (alone us, between us: the pair's time less
    the GEMM's)."""
    x = torch.randn(bs, 28672, generator=gen).to("cuda", torch.float8_e4m3fn)
    w = torch.randn(8192, 28672, generator=gen).to("cuda", torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    gemm = lambda: torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16)  # noqa: E731
    pair = time_us(lambda: (gemm(), fn()))
    return time_us(fn), pair - time_us(gemm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--kv-dtype", choices=["bf16", "e4m3"], default="bf16")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128], help="keys per tile to sweep")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="warps per program to sweep")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4], help="pipeline stages to sweep")
    ap.add_argument("--default-splits-only", action="store_true", help="sweep only the default split count")
    ap.add_argument("--f16-only", action="store_true", help="e4m3: sweep only the float16 dots")
    ap.add_argument("--beside-gemm", action="store_true", help="also time the default between FP8 GEMMs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fp8 = args.kv_dtype == "e4m3"
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    results = []
    for bs in args.batch_sizes:
        q, k, v, r2t, rows, lens = setup(bs, args.context, args.heads, args.kv_heads, kv_dtype, gen)
        ref = decode_attention_ref(q[:2], k, v, r2t, rows[:2], lens[:2], D**-0.5)
        nbytes = bs * args.context * args.kv_heads * D * 2 * kv_dtype.itemsize
        # the kernel's own choices (launch_defaults: tiles and stages by KV dtype and split count)
        splits = decode_num_splits(bs, args.kv_heads, sms, kv_dtype)
        default = {"splits": splits, "block_n": None, "warps": 4, "stages": None}
        # the defaults before V tiles were widened ahead of the dot's layout change, beside them
        unstaged = {**default, "f16_dot": fp8, "direct": default["splits"] == 1, "v_staged": False}
        found = []
        swept = settings(
            bs, args.kv_heads, sms, fp8, args.block_n, args.warps, args.stages, args.default_splits_only, args.f16_only
        )
        for st in [default, *([unstaged] if fp8 else []), *swept]:
            out = torch.empty_like(q)
            kw = dict(out=out, block_n=st["block_n"], num_warps=st["warps"], num_stages=st["stages"])
            if "f16_dot" in st:
                kw.update(f16_dot=st["f16_dot"], direct=st["direct"], v_staged=st["v_staged"])
            fn = lambda: decode_attention(q, k, v, r2t, rows, lens, D**-0.5, st["splits"], **kw)  # noqa: E731
            try:
                us = time_us(fn)
            except Exception as e:  # a setting this GPU cannot run (shared memory)
                print(f"bs {bs} {st}: {type(e).__name__}")
                continue
            err = ((out[:2].float() - ref.float()).norm() / ref.float().norm()).item()
            tag = "default" if st is default else "default, unstaged" if st is unstaged else ""
            found.append({"batch": bs, **st, "us": us, "tb_per_s": nbytes / us / 1e6, "rel_err": err, "tag": tag})
        found.sort(key=lambda r: r["us"])
        d = next(r for r in found if r["tag"] == "default")
        print(f"batch {bs} ctx {args.context} kv {args.kv_dtype}: default {d['us']:.1f} us ({d['tb_per_s']:.2f} TB/s)")
        if args.beside_gemm:
            kw = dict(out=torch.empty_like(q))
            fn = lambda: decode_attention(q, k, v, r2t, rows, lens, D**-0.5, default["splits"], **kw)  # noqa: E731
            alone, between = beside_gemm(fn, bs, gen)
            d["beside_gemm_us"] = between
            print(f"   default alone {alone:.1f} us, between FP8 GEMMs {between:.1f} us")
        for u in (r for r in found if r["tag"] == "default, unstaged"):
            print(f"   default settings, V unstaged: {u['us']:.1f} us ({u['tb_per_s']:.2f} TB/s)")
        for r in found[: args.top]:
            print(
                f"   splits {r['splits']:2d} block_n {r['block_n']} warps {r['warps']} stages {r['stages']} "
                f"f16 {r.get('f16_dot')} direct {r.get('direct')} staged {r.get('v_staged')}: "
                f"{r['us']:7.1f} us {r['tb_per_s']:.2f} TB/s "
                f"err {r['rel_err']:.1e}"
            )
        results += found
    if args.out:
        with open(args.out, "w") as f:
            meta = {k: getattr(args, k) for k in ("context", "heads", "kv_heads", "kv_dtype")}
            json.dump({"device": torch.cuda.get_device_name(0), **meta, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
