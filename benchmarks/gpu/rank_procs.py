"""One process per GPU for the multi-GPU benchmarks: spawn the ranks, return what rank 0 reports."""

from __future__ import annotations

import torch

from radixlm.srt.distributed.ranks import free_init_addr


def rank0_result(worker, world: int, args, timeout_s: float = 600):
    """Run worker(rank, world, init, args, out_q) in `world` spawned processes meeting at a free local address,
    and return the one object rank 0 puts on out_q."""
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    init = free_init_addr()
    procs = [ctx.Process(target=worker, args=(r, world, init, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=timeout_s)
    for p in procs:
        p.join(timeout=60)
    return result
