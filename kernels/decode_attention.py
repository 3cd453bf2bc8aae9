"""Decode attention over the paged KV pool (page size 1, `req_to_token` indirection), split-KV.

Stage 1 gives each (request, KV head, split) its own program: it walks its share of the request's KV slots and
keeps a running softmax for all the query heads of that KV head's group at once (a [group, D] x [D, N] dot, so
GQA uses the tensor cores). Stage 2 merges the splits by their log-sum-exp; with one split (large batches)
stage 1 writes the output itself. Splitting the KV lets one request with a long context fill the GPU
("flash-decoding"); the number of splits is fixed per batch size, so the launch is the same on every replay of a
CUDA graph while the per-request split length follows `seq_lens`. An e4m3 pool is read as float16 tiles (see
`decode_attention`'s `f16_dot`).
"""

from __future__ import annotations

import torch

from radixlm.kernels import INTERPRET, dot_precision, next_pow2
from radixlm.kernels._triton import tl, triton
from radixlm.kernels.decode_launch import (
    MAX_SPLITS,
    _max_shared,
    default_f16_dot,
    default_v_staged,
    launch_defaults,
)

_LOG2E = 1.4426950408889634


# --- torch reference -----------------------------------------------------------------------------------------
def decode_attention_ref(
    q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale: float, k_scale=1.0, v_scale=1.0
):
    """q: [B, H, D]; returns [B, H, D] (float32 math, per request, no padding)."""
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        slots = req_to_token[int(req_pool_indices[i]), :n].long()
        k = (k_cache[slots].float() * k_scale).repeat_interleave(h // kvh, 1)  # [n, H, D]
        v = (v_cache[slots].float() * v_scale).repeat_interleave(h // kvh, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * sm_scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _e4m3_to_f16_staged(x):
    """e4m3 -> float16 (exact), four elements per `cvt` pair, in the layout `x` was loaded in. Marked impure so
    that Triton cannot move the dot's layout change ahead of it: for the P x V dot, whose reduction runs along the
    tokens while a token's bytes lie along the head dim, that change would read V from shared memory one byte at a
    time (Hopper's `ldmatrix` transposes 16-bit elements only). Widened first, V is written back as float16 and
    read with transposing `ldmatrix`. Compiled code only: the interpreter cannot run inline PTX."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _attend_split(
    q_ptr,
    qb,
    k_ptr,
    v_ptr,
    r2t_ptr,
    row,
    seq_len,
    kvh,
    s,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    qk_scale,
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
    """Split `s` of `num_splits` of one request's KV for the query heads of KV head `kvh`: the split's
    normalized output [BLOCK_H, BLOCK_D] (float32) and its log-sum-exp [BLOCK_H] (log2 units; -inf for an empty
    split, which a merge weighs as zero)."""
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        q_ptr + qb * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if F16_DOT:  # e4m3 KV: e4m3 -> f16 is one exact instruction, e4m3 -> bf16 is not (see decode_attention);
        # a query element past float16's range saturates instead of becoming inf
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    elif F32_DOT:  # Triton's interpreter cannot multiply bf16 tiles
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        slots = tl.load(r2t_ptr + row * stride_r2t + n, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # e4m3 KV to the dot's dtype
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # log2 units
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if V_STAGED:
            v = _e4m3_to_f16_staged(v)
        else:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _store_heads(ptr, base, stride_h, tile, kvh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    """A [BLOCK_H, BLOCK_D] tile of KV head `kvh`'s query heads to ptr[base + head * stride_h + d]."""
    g = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (g < GROUP)[:, None] & (d < D)[None, :]
    tl.store(ptr + base + (kvh * GROUP + g)[:, None] * stride_h + d[None, :], tile, mask=mask)


@triton.jit
def _store_split(
    out,
    lse,
    kvh,
    mid_o_ptr,
    mid_lse_ptr,
    mo_base,
    ml_base,
    stride_moh,
    stride_mlh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A split's result into the partials a merge reads: mid_o[mo_base + head * stride_moh], mid_lse[ml_base +
    head * stride_mlh]."""
    _store_heads(mid_o_ptr, mo_base, stride_moh, out, kvh, GROUP=GROUP, BLOCK_H=BLOCK_H, D=D, BLOCK_D=BLOCK_D)
    g = tl.arange(0, BLOCK_H)
    tl.store(mid_lse_ptr + ml_base + (kvh * GROUP + g) * stride_mlh, lse, mask=g < GROUP)


@triton.jit
def _merge_splits(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    mo_base,
    ml_base,
    o_base,
    stride_mos,
    stride_mls,
    num_splits,
    o_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One (request, head): the splits' partial outputs (mid_o[mo_base + s * stride_mos]) weighed by their
    log-sum-exps (mid_lse[ml_base + s * stride_mls]) into out[o_base], times `o_scale` (an FP8 pool's V scale:
    the output is linear in V)."""
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(mid_lse_ptr + ml_base + s * stride_mls, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        mid_o_ptr + mo_base + s[:, None] * stride_mos + d[None, :], mask=smask[:, None] & (d[None, :] < D), other=0.0
    )
    out = tl.sum(w[:, None] * o, 0) * (o_scale / tl.sum(w, 0))
    tl.store(out_ptr + o_base + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["num_splits", "stride_mlb", "stride_mlh"])  # one kernel whatever the split count
def _decode_stage1(
    q_ptr,
    qrows_ptr,
    k_ptr,
    v_ptr,
    r2t_ptr,
    rows_ptr,
    lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    qk_scale,
    o_scale,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr,
    F16_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    V_STAGED: tl.constexpr,
    HAS_QROWS: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    qb = b.to(tl.int64)
    if HAS_QROWS:  # the request's row of q (and of out) in a larger batch
        qb = tl.load(qrows_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
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
        num_splits,
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
    if DIRECT:  # one split: its output is the answer (times an FP8 pool's V scale: the output is linear in V)
        tile = (out * o_scale).to(out_ptr.dtype.element_ty)
        _store_heads(out_ptr, qb * stride_ob, stride_oh, tile, kvh, GROUP=GROUP, BLOCK_H=BLOCK_H, D=D, BLOCK_D=BLOCK_D)
    else:
        _store_split(
            out,
            lse,
            kvh,
            mid_o_ptr,
            mid_lse_ptr,
            b * stride_mob + s * stride_mos,
            b * stride_mlb + s,
            stride_moh,
            stride_mlh,
            GROUP=GROUP,
            BLOCK_H=BLOCK_H,
            D=D,
            BLOCK_D=BLOCK_D,
        )


@triton.jit(do_not_specialize=["num_splits", "stride_mlb", "stride_mlh"])  # one kernel whatever the split count
def _decode_stage2(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    qrows_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    num_splits,
    o_scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_QROWS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ob = b.to(tl.int64)
    if HAS_QROWS:
        ob = tl.load(qrows_ptr + b).to(tl.int64)
    _merge_splits(
        mid_o_ptr,
        mid_lse_ptr,
        out_ptr,
        b * stride_mob + h * stride_moh,
        b * stride_mlb + h * stride_mlh,
        ob * stride_ob + h * stride_oh,
        stride_mos,
        1,
        num_splits,
        o_scale,
        D=D,
        BLOCK_D=BLOCK_D,
        BLOCK_S=BLOCK_S,
    )


def decode_attention(
    q,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    q_rows: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    f16_dot: bool | None = None,
    direct: bool | None = None,
    v_staged: bool | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k_cache/v_cache: [slots, KVH, D] (e4m3 with `k_scale` / `v_scale`, or q's dtype);
    req_to_token: [rows, max_ctx] int32;
    req_pool_indices/seq_lens: [B]. Reads only tensors: capturable in a CUDA graph. With `q_rows` ([B] int64),
    request i's query is q[q_rows[i]] and its output goes to out[q_rows[i]] (one-token rows of a larger
    batch, read and written in place, without a gather and a scatter around the call).
    `f16_dot` (default: for an e4m3 pool): the dots in float16, the query rounded to it, since e4m3 widens to
    float16 exactly in one instruction; `direct` (default: one split): stage 1 writes the output and no merge
    runs; `v_staged` (default: with `f16_dot` on compiled code): V widened before the P x V dot's layout change
    (see `_e4m3_to_f16_staged`)."""
    h, d = q.shape[1], q.shape[2]
    b = q.shape[0] if q_rows is None else q_rows.shape[0]
    kvh = k_cache.shape[1]
    group = h // kvh
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    assert 1 <= num_splits <= MAX_SPLITS
    block_n, num_stages = launch_defaults(k_cache.dtype, num_splits, block_n, num_stages, d, _max_shared(q))
    if f16_dot is None:
        f16_dot = default_f16_dot(k_cache.dtype, q.dtype)
    if direct is None:
        direct = num_splits == 1
    if v_staged is None:
        v_staged = default_v_staged(k_cache.dtype, f16_dot)
    assert not v_staged or (f16_dot and k_cache.dtype == torch.float8_e4m3fn and not INTERPRET)
    assert not direct or num_splits == 1
    if direct:  # no partials: the output is written in stage 1 (the pointers below are never read)
        mid_o, mid_lse = out, out
        mo_strides, ml_strides = (0, 0, 0), (0, 0)
    else:
        mid_o = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
        mo_strides, ml_strides = mid_o.stride()[:3], mid_lse.stride()[:2]
    block_d = next_pow2(d)
    rows_arg = q_rows if q_rows is not None else seq_lens  # any int tensor when unused (HAS_QROWS=False)
    _decode_stage1[(b, kvh, num_splits)](
        q,
        rows_arg,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        out,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        req_to_token.stride(0),
        *mo_strides,
        *ml_strides,
        out.stride(0),
        out.stride(1),
        sm_scale * k_scale * _LOG2E,
        v_scale,
        num_splits,
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        D=d,
        BLOCK_D=block_d,
        F32_DOT=INTERPRET,
        F16_DOT=f16_dot,
        DOT_PREC=dot_precision(q.dtype),
        V_STAGED=v_staged,
        HAS_QROWS=q_rows is not None,
        DIRECT=direct,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if direct:
        return out
    _decode_stage2[(b, h)](
        mid_o,
        mid_lse,
        out,
        rows_arg,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        v_scale,
        D=d,
        BLOCK_D=block_d,
        BLOCK_S=max(2, next_pow2(MAX_SPLITS)),
        HAS_QROWS=q_rows is not None,
        num_warps=4,
    )  # one compiled kernel for every split count
    return out
