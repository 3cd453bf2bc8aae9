"""Investigation (issue 32, eighteenth session): would a prefill chunk's row-parallel projections (o and down of
the 70B shape, FP8 weights) gain from computing in row pieces whose async all-reduces overlap the next piece's
product? Times plain (the product, then one NCCL all-reduce) against pipelined (up to four pieces of at least
512 rows, the all-reduces started as each piece is done), and each part alone (the product; the all-reduce):
per call, median of the timed repeats, rank 0's clock. On 2 x H200 the pipelined call was no faster (results
README, "Eighteenth session"), so the runtime does not pipeline. `--carveouts` times it again with cuBLAS told
to leave SMs free (torch's experimental SM carve-out), so that NCCL's kernels can run beside the GEMM: not yet run.

Usage (a host with at least WORLD GPUs): python tools/prefill_overlap.py --world 2 --out F.json"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository (this file: tools/)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))

from rank_procs import rank0_result  # noqa: E402

# (name, input features of the whole model, output features): the 70B's o and down projections
SHAPES = [("o", 8192, 8192), ("down", 28672, 8192)]


def _worker(rank: int, world: int, init: str, args, out_q) -> None:
    import torch.distributed as dist

    from radixlm.srt.distributed.parallel import init_tensor_parallel
    from radixlm.srt.layers.quantization.fp8 import Fp8Linear

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    tp = init_tensor_parallel(world, rank, init, "nccl", 60)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            dist.barrier(group=tp.group)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def pipelined(quant, x):
        pieces = min(4, x.shape[0] // 512)
        parts, pending = [], []
        for rows in x.split(-(-x.shape[0] // pieces)):
            part = quant.matmul(rows)
            pending.append(dist.all_reduce(part, group=tp.group, async_op=True))
            parts.append(part)
        for work in pending:
            work.wait()
        return torch.cat(parts)

    def plain(quant, x):
        return tp.all_reduce(quant.matmul(x))

    rows_out = []
    for name, k_all, n in SHAPES:
        k = k_all // world
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        quant = Fp8Linear.from_weight(w)
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
            y = quant.matmul(x)
            row = {"shape": name, "rows": rows, "k": k, "n": n, "world": world}
            row["product_ms"] = ms(lambda: quant.matmul(x))
            row["all_reduce_ms"] = ms(lambda: tp.all_reduce(y))
            row["plain_ms"] = ms(lambda: plain(quant, x))
            row["pipelined_ms"] = ms(lambda: pipelined(quant, x))
            for sms in args.carveouts:  # cuBLAS's GEMMs leave this many SMs to NCCL's kernels
                torch._C._set_sm_carveout_experimental(sms)
                row[f"pipelined_carveout{sms}_ms"] = ms(lambda: pipelined(quant, x))
                torch._C._set_sm_carveout_experimental(None)
            a, b = plain(quant, x), pipelined(quant, x)
            row["max_abs_diff"] = (a.float() - b.float()).abs().max().item()  # a sum of two ranks: 0
            rows_out.append(row)
    if rank == 0:
        out_q.put(rows_out)
    dist.barrier(group=tp.group)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--carveouts", type=int, nargs="*", default=[16, 32], help="also time pipelined with cuBLAS leaving N SMs free"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = rank0_result(_worker, args.world, args)
    print(f"{'shape':>5} {'rows':>5} | {'product':>8} {'all-red':>8} {'plain':>8} {'piped':>8} {'gain':>6}  (ms/call)")
    for r in rows:
        gain = r["plain_ms"] / r["pipelined_ms"]
        print(
            f"{r['shape']:>5} {r['rows']:>5} | {r['product_ms']:8.3f} {r['all_reduce_ms']:8.3f} {r['plain_ms']:8.3f} "
            f"{r['pipelined_ms']:8.3f} {gain:5.2f}x  diff {r['max_abs_diff']:.3g}"
            + "".join(f"  carve-out {c}: {r[f'pipelined_carveout{c}_ms']:.3f}" for c in args.carveouts)
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "repeats": args.repeats}
    args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
