"""Attention for requests that add a few tokens each (a speculative verify step: the last token and its draft;
short prompt tails after a cache hit), over the paged pool, in one fixed launch.

The extend kernel gives each (request, block of 64-128 query rows, query head) a program and reads the request's
KV once per query head: for two to nine new tokens a request, nearly every row of its tiles is empty and the KV
is read GROUP times over. Here a program owns one (request, KV head, split of the KV): its query tile holds every
new token of the request for all the query heads of that KV head (row = token * GROUP + head in the group), so the
KV is read once per KV head as in decode attention, and the causal mask lets token j see keys up to its own
position. As in `decode_attention_rows`, the request count and the split count are read on the device (`ctl`)
and the grid is sized for the most items the buffers have room for, so a CUDA graph holds the launch whatever the
batch; with one split (many requests) stage 1 writes the output itself, else stage 2 merges the splits by their
log-sum-exps.
"""

from __future__ import annotations

import torch

from radixlm.kernels import INTERPRET, dot_precision, next_pow2
from radixlm.kernels._triton import tl, triton
from radixlm.kernels.decode_attention import _LOG2E, _e4m3_to_f16_staged
from radixlm.kernels.decode_launch import (
    _max_shared,
    decode_num_splits,
    default_f16_dot,
    default_v_staged,
    launch_defaults,
)

_TILE_ROWS = 64  # query rows a program holds: tokens x GROUP, so a request of up to 64 // GROUP new tokens fits


def short_max_tokens(group: int) -> int:
    """The most new tokens a request may have to take this kernel (at least 2, or none take it: 0)."""
    t = _TILE_ROWS // max(1, group)
    return t if t >= 2 else 0


def short_splits(num_reqs: int, num_kv_heads: int, num_sms: int, kv_dtype: torch.dtype | None = None) -> int:
    """KV splits per (request, KV head): as decode attention's for that many rows (each item reads the same KV)."""
    return decode_num_splits(num_reqs, num_kv_heads, num_sms, kv_dtype)


def short_caps(
    max_reqs: int, num_kv_heads: int, num_sms: int, kv_dtype: torch.dtype | None = None, least: int = 1
):  # fmt: skip
    """For batches of `least` to `max_reqs` requests (least = max_reqs: a batch of exactly that many): (the most
    (request, split) items, the most requests split more than once, the most items of such a batch): the stage-1
    grid, the merge grid and the partials' buffer."""
    items, merged, buffered = 0, 0, 0
    for n in range(max(1, least), max(1, max_reqs) + 1):
        s = short_splits(n, num_kv_heads, num_sms, kv_dtype)
        items = max(items, n * s)
        if s > 1:
            merged, buffered = max(merged, n), max(buffered, n * s)
    return items, merged, buffered


# --- torch reference -----------------------------------------------------------------------------------------
def short_extend_attention_ref(
    q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_starts, sm_scale,
    k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """q: [T, H, D]; returns out with the listed requests' rows filled (others zero; float32 math)."""
    h = q.shape[1]
    kvh = k_cache.shape[1]
    out = torch.zeros_like(q)
    for i in range(len(extend_lens)):
        p, e, s0 = int(prefix_lens[i]), int(extend_lens[i]), int(q_starts[i])
        slots = req_to_token[int(req_pool_indices[i]), : p + e].long()
        k = (k_cache[slots].float() * k_scale).repeat_interleave(h // kvh, 1)
        v = (v_cache[slots].float() * v_scale).repeat_interleave(h // kvh, 1)
        s = torch.einsum("qhd,nhd->hqn", q[s0 : s0 + e].float(), k) * sm_scale
        causal = torch.arange(p + e, device=q.device)[None, :] <= (p + torch.arange(e, device=q.device))[:, None]
        s = s.masked_fill(~causal, float("-inf"))
        out[s0 : s0 + e] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v).to(q.dtype)
    return out


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _short_stage1(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    r2t_ptr,
    rows_ptr,
    prefix_ptr,
    ext_ptr,
    qstart_ptr,
    ctl_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t,
    stride_moi,
    stride_mot,
    stride_moh,
    stride_mli,
    stride_mlt,
    qk_scale,
    o_scale,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr,
    F16_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    V_STAGED: tl.constexpr,
):
    n_reqs = tl.load(ctl_ptr).to(tl.int32)
    splits = tl.load(ctl_ptr + 1).to(tl.int32)
    item = tl.program_id(0)
    per_req = KVH * splits
    if item >= n_reqs * per_req:
        return
    b = item // per_req
    kvh = (item % per_req) // splits
    s = item % splits
    row = tl.load(rows_ptr + b).to(tl.int64)
    prefix = tl.load(prefix_ptr + b).to(tl.int32)
    ext = tl.load(ext_ptr + b).to(tl.int32)
    q0 = tl.load(qstart_ptr + b).to(tl.int64)

    r = tl.arange(0, BLOCK_M)
    j = r // GROUP  # the row's token among the request's new ones
    heads = kvh * GROUP + r % GROUP
    rmask = j < ext
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        q_ptr + (q0 + j)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if F16_DOT:  # e4m3 KV: float16 dots, as decode attention's (a query past float16's range saturates)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    elif F32_DOT:  # Triton's interpreter cannot multiply bf16 tiles
        q = q.to(tl.float32)
    q_pos = prefix + j
    kv_end = prefix + ext
    split_len = tl.cdiv(tl.cdiv(kv_end, splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, kv_end)
    r2t_row = r2t_ptr + row * stride_r2t
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        slots = tl.load(r2t_row + n, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # log2 units
        qk = tl.where(nmask[None, :] & (n[None, :] <= q_pos[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row may see no key of this split yet (its position lies before the split's end): keep it at zero
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if V_STAGED:
            v = _e4m3_to_f16_staged(v)
        else:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    has = l_i > 0
    smask = rmask[:, None] & dmask[None, :]
    if splits == 1:
        out = acc * (o_scale / tl.where(has, l_i, 1.0))[:, None]
        tl.store(
            o_ptr + (q0 + j)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=smask,
        )
    else:
        mid = (b * splits + s).to(tl.int64)
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(
            mid_o_ptr + mid * stride_moi + j[:, None] * stride_mot + heads[:, None] * stride_moh + d[None, :],
            out,
            mask=smask,
        )
        tl.store(mid_lse_ptr + mid * stride_mli + j * stride_mlt + heads, lse, mask=rmask)


@triton.jit
def _short_stage2(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    ext_ptr,
    qstart_ptr,
    ctl_ptr,
    stride_moi,
    stride_mot,
    stride_moh,
    stride_mli,
    stride_mlt,
    stride_ot,
    stride_oh,
    o_scale,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One (request, head) a program, all its tokens at once: a grid per token would be mostly programs with
    # nothing to do, and a loop over the tokens would chain their loads' latencies. The splits are folded in
    # as an online softmax over their log-sum-exps.
    n_reqs = tl.load(ctl_ptr).to(tl.int32)
    splits = tl.load(ctl_ptr + 1).to(tl.int32)
    item = tl.program_id(0)
    if splits == 1 or item >= n_reqs * H:
        return
    b = item // H
    h = item % H
    t = tl.arange(0, BLOCK_T)
    tmask = t < tl.load(ext_ptr + b).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    mask = tmask[:, None] & (d < D)[None, :]
    q0 = tl.load(qstart_ptr + b).to(tl.int64)
    first = (b * splits).to(tl.int64)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for s in range(0, splits):
        mid = first + s
        lse = tl.load(mid_lse_ptr + mid * stride_mli + t * stride_mlt + h, mask=tmask, other=float("-inf"))
        o = tl.load(
            mid_o_ptr + mid * stride_moi + t[:, None] * stride_mot + h * stride_moh + d[None, :], mask=mask, other=0.0
        )
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split so far saw a key (an empty split)
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref)
        acc = acc * alpha[:, None] + w[:, None] * o
        w_sum = w_sum * alpha + w
        m = m_new
    out = acc * (o_scale / tl.where(w_sum > 0, w_sum, 1.0))[:, None]
    tl.store(
        out_ptr + (q0 + t)[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def short_extend_attention(
    q,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    q_starts,
    ctl,
    sm_scale: float,
    out: torch.Tensor,
    caps: tuple[int, int, int],
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention for the first ctl[0] requests of req_pool_indices / prefix_lens / extend_lens / q_starts (device
    tensors; each request's new tokens are q[q_starts[i] : q_starts[i] + extend_lens[i]], at most
    `short_max_tokens(GROUP)` of them, their K/V already in the pool), each request's KV split ctl[1] ways;
    writes those rows of `out`. `caps`: `short_caps` of the room (or of the batch itself): the launch depends only
    on them and the shapes, never on ctl, so a CUDA graph replays it for any batch that fits."""
    h, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[1]
    group = h // kvh
    items, merged, buffered = caps
    if items == 0 or req_pool_indices.shape[0] == 0:
        return out
    t_max = short_max_tokens(group)
    mid_o = torch.empty((max(buffered, 1), t_max, h, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((max(buffered, 1), t_max, h), dtype=torch.float32, device=q.device)
    block_d = next_pow2(d)
    block_n, num_stages = launch_defaults(k_cache.dtype, 1, None, None, d, _max_shared(q))
    f16_dot = default_f16_dot(k_cache.dtype, q.dtype)
    _short_stage1[(items * kvh,)](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        q_starts,
        ctl,
        mid_o,
        mid_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        sm_scale * k_scale * _LOG2E,
        v_scale,
        KVH=kvh,
        GROUP=group,
        BLOCK_M=max(16, next_pow2(t_max * group)),
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
    if merged:
        _short_stage2[(merged * h,)](
            mid_o,
            mid_lse,
            out,
            extend_lens,
            q_starts,
            ctl,
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            v_scale,
            H=h,
            D=d,
            BLOCK_T=max(2, next_pow2(t_max)),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out
