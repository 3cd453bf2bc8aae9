"""Time the all-reduce + residual add + RMSNorm of a decode step, per call: NCCL's all-reduce followed by our norm
kernel (what radixlm ran before, and runs with --disable-custom-all-reduce) against the fused kernel over
symmetric memory (srt/distributed/fused_all_reduce.py; from four ranks on in both its schemes, one-shot and
two-shot), each as 64 calls in one CUDA graph, at decode row
counts and the Llama hidden sizes (8B: 4096, 70B: 8192), bf16 rows and e4m3 rows (an FP8 projection next).

Usage (a host with at least WORLD GPUs): python benchmarks/gpu/bench_allreduce_norm.py --world 2 --out F.json
Prints a table (us per call, rank 0's clock) and writes JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rank_procs import rank0_result  # noqa: E402  (this directory)

CALLS = 64


def _worker(rank: int, world: int, init: str, args, out_q) -> None:
    import torch.distributed as dist

    from radixlm.kernels.gemv import _time_calls
    from radixlm.kernels.norm import fused_add_rmsnorm_, rmsnorm_fp8
    from radixlm.srt.distributed import fused_all_reduce
    from radixlm.srt.distributed.fused_all_reduce import setup
    from radixlm.srt.distributed.parallel import init_tensor_parallel

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    tp = init_tensor_parallel(world, rank, init, "nccl", 60)

    def per_call_us(fn) -> float:  # CALLS calls back to back in one CUDA graph, median of 20 replays
        return _time_calls([fn], rounds=CALLS, graph_reps=20) * 1e3

    if args.per_peer_kib:  # past the runtime's limits: its buffer size and its row cap
        fused_all_reduce.PER_PEER_BYTES[world] = args.per_peer_kib << 10
        fused_all_reduce.MAX_ROWS.pop(world, None)
    fused = setup(tp, dev)
    rows_out = []
    for n in args.hidden:
        w = torch.ones(n, dtype=torch.bfloat16, device=dev)
        for rows in args.rows:
            x = torch.randn(rows, n, device=dev).to(torch.bfloat16)
            res = torch.randn(rows, n, device=dev).to(torch.bfloat16)
            row = {"hidden": n, "rows": rows, "world": world}
            for quant in (False, True):
                tag = "fp8" if quant else "bf16"

                def nccl(quant=quant):
                    dist.all_reduce(x, group=tp.group)
                    return rmsnorm_fp8(x, res, w, 1e-5) if quant else fused_add_rmsnorm_(x, res, w, 1e-5)

                row[f"nccl_norm_{tag}_us"] = per_call_us(nccl)
                if fused is not None and fused.takes(x):  # both schemes from four ranks on (one-shot below)
                    for two, key in ((False, "fused"), (True, "two_shot")) if world >= 4 else ((False, "fused"),):
                        row[f"{key}_{tag}_us"] = per_call_us(
                            lambda q=quant, t=two: fused(x, res, w, 1e-5, quant=q, two_shot=t)
                        )
            rows_out.append(row)
    if rank == 0:
        out_q.put(rows_out)
    dist.barrier(group=tp.group)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--per-peer-kib",
        type=int,
        help="the fused kernel's buffer (KiB a peer) instead of the runtime's PER_PEER_BYTES for this world size: "
        "times it past the size where the runtime hands over to NCCL",
    )
    args = ap.parse_args()
    rows = rank0_result(_worker, args.world, args)
    head = f"{'hidden':>6} {'rows':>5} | {'NCCL+norm':>9} {'fused':>7} {'2-shot':>7} |"
    print(head + f" {'NCCL+norm':>9} {'fused':>7} {'2-shot':>7}  (us/call; bf16 rows | e4m3 rows; fused: one-shot)")
    for r in rows:
        f = lambda k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        print(
            f"{r['hidden']:>6} {r['rows']:>5} | {f('nccl_norm_bf16_us'):>9} {f('fused_bf16_us'):>7} "
            f"{f('two_shot_bf16_us'):>7} | {f('nccl_norm_fp8_us'):>9} {f('fused_fp8_us'):>7} {f('two_shot_fp8_us'):>7}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "calls_per_graph": CALLS,
            "per_peer_kib": args.per_peer_kib}  # fmt: skip
    args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
