"""Synthetic batches on a model runner's own pools, for what compares or times the runner's paths without a
scheduler (the decode benchmark, the graph-runner tests): allocate rows and slots, describe the batch, give
them back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode

if TYPE_CHECKING:
    from radixlm.srt.model_executor.model_runner import ModelRunner


def mixed_spec(
    r: ModelRunner, decodes: int, ctx: int, prompt: int, ids: list[int] | None = None, all_logits: bool = False
) -> tuple[BatchSpec, torch.Tensor, list[int]]:
    """An extend batch of `decodes` requests decoding at context `ctx` plus one new `prompt`-token request, on
    runner `r`'s pools; returns (spec, KV slots, request rows) for `release`. Logits: each request's last row,
    or every row."""
    rows = [r.req_to_token_pool.alloc() for _ in range(decodes + 1)]
    slots = r.token_to_kv_pool.alloc(decodes * (ctx + 1) + prompt)
    for i, row in enumerate(rows[:decodes]):
        r.req_to_token_pool.write(row, 0, slots[i * (ctx + 1) : (i + 1) * (ctx + 1)])
    new = slots[decodes * (ctx + 1) :]
    r.req_to_token_pool.write(rows[-1], 0, new)
    loc = torch.cat([slots[: decodes * (ctx + 1)].view(decodes, ctx + 1)[:, ctx], new])
    t = decodes + prompt
    spec = BatchSpec(
        ForwardMode.EXTEND,
        ids or [100 + i % 1000 for i in range(t)],
        [ctx] * decodes + list(range(prompt)),
        rows,
        [ctx + 1] * decodes + [prompt],
        loc,
        logits_indices=list(range(t)) if all_logits else list(range(decodes)) + [t - 1],
        extend_prefix_lens=[ctx] * decodes + [0],
        extend_seq_lens=[1] * decodes + [prompt],
    )
    return spec, slots, rows


def decode_spec(r: ModelRunner, bs: int, ctx: int) -> tuple[BatchSpec, torch.Tensor, list[int]]:
    """A decode batch of `bs` requests at context `ctx` on runner `r`'s pools; (spec, KV slots, rows)."""
    rows = [r.req_to_token_pool.alloc() for _ in range(bs)]
    slots = r.token_to_kv_pool.alloc(bs * (ctx + 1))
    for i, row in enumerate(rows):
        r.req_to_token_pool.write(row, 0, slots[i * (ctx + 1) : (i + 1) * (ctx + 1)])
    loc = slots.view(bs, ctx + 1)[:, ctx].clone()
    spec = BatchSpec(ForwardMode.DECODE, [100 + i for i in range(bs)], [ctx] * bs, rows, [ctx + 1] * bs, loc)
    return spec, slots, rows


def release(r: ModelRunner, slots: torch.Tensor, rows: list[int]) -> None:
    r.token_to_kv_pool.free(slots)
    for row in rows:
        r.req_to_token_pool.free(row)
