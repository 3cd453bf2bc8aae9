"""A CUDA graph's inputs, read by the graph itself from pinned host memory.

The host writes a step's inputs (one flat int64 vector per graph bucket: ids first, then positions, KV slots and
whatever else the graph kind reads) into the next slot of a ring of pinned buffers and launches the graph; the
graph's first kernel reads that slot over the bus (pinned memory is mapped into the device's address space),
swaps ids that are futures (negative: -1 - index into `future_map`, a token an earlier step sampled on the
device) for the token, and writes the graph's static input buffer. So a replay is a few numpy stores and one
graph launch: no separate copy, no event, no eager index kernels before it. Which slot a replay reads is kept
on the device (`counter`): every program of the launch reads it, and the last one to finish advances it, so a
replay needs no per-replay argument (replays run in launch order, and the host keeps its own count in step).
"""

from __future__ import annotations

import torch

from radixlm.kernels._triton import tl, triton

_BLOCK = 1024


def pull_inputs_ref(
    ring: torch.Tensor, counter: torch.Tensor, static: torch.Tensor, future_map: torch.Tensor, num_ids: int
) -> torch.Tensor:
    """ring [R, N], counter [1], static [N], future_map [F]; the first `num_ids` entries are ids."""
    turn = int(counter[0])
    vals = ring[turn % ring.shape[0]].to(static.device).clone()
    ids = vals[:num_ids]
    fut = ids < 0
    ids[fut] = future_map[(-ids[fut] - 1)].to(ids.dtype)
    static.copy_(vals)
    counter[0] = turn + 1
    return static


@triton.jit
def _pull_inputs_kernel(
    ring_ptr, counter_ptr, done_ptr, static_ptr, future_ptr, n, num_ids, RING: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    turn = tl.load(counter_ptr)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # .cv: fetch from host memory again, never from a line an earlier replay's read left cached
    vals = tl.load(ring_ptr + (turn % RING) * n + offs, mask=mask, other=0, cache_modifier=".cv")
    fut = mask & (offs < num_ids) & (vals < 0)
    vals = tl.where(fut, tl.load(future_ptr + (-vals - 1), mask=fut, other=0), vals)
    tl.store(static_ptr + offs, vals, mask=mask)
    # The last program to get here (each read the counter before its increment) advances it for the next replay.
    if tl.atomic_add(done_ptr, 1) == tl.num_programs(0) - 1:
        tl.store(done_ptr, 0)
        tl.store(counter_ptr, turn + 1)


def pull_inputs(
    ring: torch.Tensor, counter: torch.Tensor, static: torch.Tensor, future_map: torch.Tensor, num_ids: int
) -> torch.Tensor:
    """One launch; capturable. ring: contiguous [R, N] int64 (pinned host memory on CUDA); counter: [2] int64
    on the device (the slot count, then the kernel's own scratch)."""
    r, n = ring.shape
    assert ring.is_contiguous() and static.is_contiguous() and static.numel() == n and counter.numel() == 2
    block = min(_BLOCK, max(16, triton.next_power_of_2(n)))
    _pull_inputs_kernel[(triton.cdiv(n, block),)](
        ring, counter, counter[1:], static, future_map, n, num_ids, RING=r, BLOCK=block, num_warps=4
    )
    return static
