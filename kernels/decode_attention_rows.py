"""Decode attention for the one-token rows of a mixed batch (requests decoding beside a prompt chunk) in one
fixed launch: the row count and each row's split count are read on the device, so a CUDA graph holds the
launch whatever the batch. The per-split walk and the merge are `decode_attention`'s."""

from __future__ import annotations

import torch

from radixlm.kernels import INTERPRET, dot_precision, next_pow2
from radixlm.kernels._triton import tl, triton
from radixlm.kernels.decode_attention import _LOG2E, _attend_split, _merge_splits, _store_split
from radixlm.kernels.decode_launch import (
    MAX_SPLITS,
    _max_shared,
    decode_num_splits,
    default_f16_dot,
    default_v_staged,
    launch_defaults,
)


# Rows of a mixed batch (one-token requests riding along a prompt chunk) in a fixed launch: how many rows there
# are and how many splits each gets are read on the device (`ctl`), and the grid is sized for the most
# (row, KV head, split) items the buffers have room for, the programs past the batch's items returning at once.
# So the launch is the same whatever the batch and a CUDA graph holds it. The partial results are kept per item
# (row * splits + split), which bounds their buffer by rows x splits.
@triton.jit
def _rows_stage1(
    q_ptr,
    qrows_ptr,
    k_ptr,
    v_ptr,
    r2t_ptr,
    rows_ptr,
    lens_ptr,
    ctl_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    stride_moi,
    stride_moh,
    stride_mli,
    qk_scale,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr,
    F16_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    n = tl.load(ctl_ptr).to(tl.int32)
    splits = tl.load(ctl_ptr + 1).to(tl.int32)
    item = tl.program_id(0)
    per_row = KVH * splits
    if item >= n * per_row:
        return
    b = item // per_row
    kvh = (item % per_row) // splits
    s = item % splits
    qb = tl.load(qrows_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    mid = (b * splits + s).to(tl.int64)
    out, lse = _attend_split(
        q_ptr,
        qb,
        k_ptr,
        v_ptr,
        r2t_ptr,
        row,
        seq_len,
        kvh,
        s,
        splits,
        stride_qb,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_r2t,
        qk_scale,
        GROUP=GROUP,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        D=D,
        BLOCK_D=BLOCK_D,
        F32_DOT=F32_DOT,
        F16_DOT=F16_DOT,
        DOT_PREC=DOT_PREC,
        V_STAGED=V_STAGED,
    )
    _store_split(
        out,
        lse,
        kvh,
        mid_o_ptr,
        mid_lse_ptr,
        mid * stride_moi,
        mid * stride_mli,
        stride_moh,
        1,
        GROUP=GROUP,
        BLOCK_H=BLOCK_H,
        D=D,
        BLOCK_D=BLOCK_D,
    )


@triton.jit
def _rows_stage2(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    qrows_ptr,
    ctl_ptr,
    stride_moi,
    stride_moh,
    stride_mli,
    stride_ob,
    stride_oh,
    o_scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    n = tl.load(ctl_ptr).to(tl.int32)
    splits = tl.load(ctl_ptr + 1).to(tl.int32)
    item = tl.program_id(0)
    if item >= n * H:
        return
    b = item // H
    h = item % H
    ob = tl.load(qrows_ptr + b).to(tl.int64)
    first = (b * splits).to(tl.int64)
    _merge_splits(
        mid_o_ptr,
        mid_lse_ptr,
        out_ptr,
        first * stride_moi + h * stride_moh,
        first * stride_mli + h,
        ob * stride_ob + h * stride_oh,
        stride_moi,
        stride_mli,
        splits,
        o_scale,
        D=D,
        BLOCK_D=BLOCK_D,
        BLOCK_S=BLOCK_S,
    )


def rows_items_cap(max_rows: int, num_kv_heads: int, num_sms: int, kv_dtype: torch.dtype | None = None) -> int:
    """The most (row, split) items a batch of up to `max_rows` rows needs when each gets
    decode_num_splits(rows) splits: what `decode_attention_rows` buffers for."""
    return max(n * decode_num_splits(n, num_kv_heads, num_sms, kv_dtype) for n in range(1, max(1, max_rows) + 1))


def decode_attention_rows(
    q,
    k_cache,
    v_cache,
    req_to_token,
    q_rows,
    req_pool_indices,
    seq_lens,
    ctl,
    sm_scale: float,
    out: torch.Tensor,
    max_items: int,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention for the first ctl[0] entries of q_rows / req_pool_indices / seq_lens, each split
    ctl[1] ways (ctl: a device int tensor); reads q[q_rows[i]] and writes out[q_rows[i]]. The launch depends
    only on the shapes and `max_items` (>= ctl[0] * ctl[1]), never on ctl: a CUDA graph replays it for any
    row count that fits."""
    h, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[1]
    if max_items == 0 or q_rows.shape[0] == 0:
        return out
    mid_o = torch.empty((max_items, h, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((max_items, h), dtype=torch.float32, device=q.device)
    block_d = next_pow2(d)
    # the split count is the device's, so the tile is chosen as for a few splits (many rows)
    block_n, num_stages = launch_defaults(k_cache.dtype, 1, block_n, None, d, _max_shared(q))
    f16_dot = default_f16_dot(k_cache.dtype, q.dtype)
    _rows_stage1[(max_items * kvh,)](
        q,
        q_rows,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        ctl,
        mid_o,
        mid_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_lse.stride(0),
        sm_scale * k_scale * _LOG2E,
        KVH=kvh,
        GROUP=h // kvh,
        BLOCK_H=max(16, next_pow2(h // kvh)),
        BLOCK_N=block_n,
        D=d,
        BLOCK_D=block_d,
        F32_DOT=INTERPRET,
        F16_DOT=f16_dot,
        DOT_PREC=dot_precision(q.dtype),
        V_STAGED=default_v_staged(k_cache.dtype, f16_dot),
        num_warps=4,
        num_stages=num_stages,
    )
    _rows_stage2[(q_rows.shape[0] * h,)](
        mid_o,
        mid_lse,
        out,
        q_rows,
        ctl,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_lse.stride(0),
        out.stride(0),
        out.stride(1),
        v_scale,
        H=h,
        D=d,
        BLOCK_D=block_d,
        BLOCK_S=max(2, next_pow2(MAX_SPLITS)),
        num_warps=4,
    )
    return out
