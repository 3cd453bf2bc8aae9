"""A decode graph's inputs, read by the graph itself from pinned host memory.

The host writes a step's inputs ([5, bs] int64: ids, positions, request rows, sequence lengths, KV slots) into
the next slot of a ring of pinned buffers and launches the graph; the graph's first kernel reads that slot
over the bus (pinned memory is mapped into the device's address space), swaps ids that are futures (negative:
-1 - index into `future_map`, a token an earlier step sampled on the device) for the token, and writes the
graph's static input buffer. So a replay is a few numpy stores and one graph launch: no separate copy, no
event, no eager index kernels before it. Which slot a replay reads is kept on the device (`counter`, advanced by
the kernel), so it needs no per-replay argument: replays run in launch order, and the host advances its own
count in step with its launches.
"""
from __future__ import annotations

import torch

from radixlm.kernels._triton import tl, triton


def pull_inputs_ref(ring: torch.Tensor, counter: torch.Tensor, static: torch.Tensor,
                    future_map: torch.Tensor) -> torch.Tensor:
    """ring [R, 5, bs], counter [1], static [5, bs], future_map [F]: what the kernel does, in torch."""
    turn = int(counter[0])
    vals = ring[turn % ring.shape[0]].to(static.device).clone()
    ids = vals[0]
    fut = ids < 0
    ids[fut] = future_map[(-ids[fut] - 1)].to(ids.dtype)
    static.copy_(vals)
    counter[0] = turn + 1
    return static


@triton.jit
def _pull_inputs_kernel(ring_ptr, counter_ptr, static_ptr, future_ptr, bs, RING: tl.constexpr,
                        BLOCK: tl.constexpr):
    turn = tl.load(counter_ptr)
    n = 5 * bs
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    # .cv: fetch from host memory again, never from a line an earlier replay's read left cached
    vals = tl.load(ring_ptr + (turn % RING) * n + offs, mask=mask, other=0, cache_modifier=".cv")
    fut = mask & (offs < bs) & (vals < 0)  # the first row holds the ids
    vals = tl.where(fut, tl.load(future_ptr + (-vals - 1), mask=fut, other=0), vals)
    tl.store(static_ptr + offs, vals, mask=mask)
    tl.store(counter_ptr, turn + 1)


def pull_inputs(ring: torch.Tensor, counter: torch.Tensor, static: torch.Tensor,
                future_map: torch.Tensor) -> torch.Tensor:
    """One launch; capturable. ring: contiguous [R, 5, bs] int64 (pinned host memory on CUDA)."""
    r, five, bs = ring.shape
    assert five == 5 and ring.is_contiguous() and static.is_contiguous() and static.shape == (5, bs)
    _pull_inputs_kernel[(1,)](ring, counter, static, future_map, bs, RING=r,
                              BLOCK=max(16, triton.next_power_of_2(5 * bs)), num_warps=4)
    return static
