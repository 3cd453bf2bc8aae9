"""Host cost of announcing one tensor-parallel step: the binary step record over a gloo group
(srt/distributed/step_record.py) against pickling the same record through broadcast_object_list (what rank 0
did before). Two local processes; microseconds per step as rank 0 sees them.

    python tools/step_record_cost.py
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixlm.srt.distributed.step_record import FORWARD, StepChannel, decode, encode
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode

STEPS = 300


def _spec(bs: int) -> BatchSpec:
    return BatchSpec(ForwardMode.DECODE, [-(i + 1) for i in range(bs)], [500] * bs, list(range(bs)), [501] * bs,
                     torch.arange(bs))  # fmt: skip


def _time(fn, group) -> float:
    for _ in range(2):  # the first pass warms up
        dist.barrier(group=group)
        t = time.perf_counter()
        for _ in range(STEPS):
            fn()
        dt = (time.perf_counter() - t) / STEPS
    return dt


def _rank(rank: int, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, world_size=2, rank=rank)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=1))
    channel = StepChannel(group)
    for bs in (1, 32, 128):
        spec, journal = _spec(bs), [("write", (3, 500, torch.tensor([7])))]

        def binary():
            if rank == 0:
                channel.send(encode(FORWARD, spec, journal, [(bs, torch.int64)]))
            else:
                decode(channel.recv())

        def pickled():
            box = [("forward", journal, spec) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=group)

        new, old = _time(binary, group), _time(pickled, group)
        if rank == 0:
            print(f"batch {bs:4d}: step record {new * 1e6:6.0f} us, pickled record {old * 1e6:6.0f} us "
                  f"({old / new:.1f}x)", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(f"tcp://127.0.0.1:{port}",), nprocs=2, start_method="spawn")
