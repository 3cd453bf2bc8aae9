"""Extend (prefill) attention over the paged pool: each request's new tokens attend to its cached prefix and,
causally, to themselves. Ragged across requests: a program owns one block of one request's new tokens for one
query head, so nothing is padded to the longest request. Which (request, block) a program owns comes from a
block table, so the launch depends only on the table's length: a CUDA graph holds it for any batch that fits.
The new tokens' K/V are already in the pool (the rope kernel stored them), so prefix and new part are read the
same way, through `req_to_token`.
"""

from __future__ import annotations

import torch

from radixlm.kernels import INTERPRET, dot_precision, next_pow2
from radixlm.kernels._triton import tl, triton

_LOG2E = 1.4426950408889634


# --- torch reference -----------------------------------------------------------------------------------------
def extend_attention_ref(
    q,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    sm_scale: float,
    k_scale=1.0,
    v_scale=1.0,
) -> torch.Tensor:
    """q: [T, H, D] (requests' new tokens back to back); returns [T, H, D]."""
    h = q.shape[1]
    kvh = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for i in range(len(extend_lens)):
        p, e = int(prefix_lens[i]), int(extend_lens[i])
        slots = req_to_token[int(req_pool_indices[i]), : p + e].long()
        k = (k_cache[slots].float() * k_scale).repeat_interleave(h // kvh, 1)
        v = (v_cache[slots].float() * v_scale).repeat_interleave(h // kvh, 1)
        s = torch.einsum("qhd,nhd->hqn", q[start : start + e].float(), k) * sm_scale
        causal = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]
        s = s.masked_fill(~causal.to(s.device), float("-inf"))
        out[start : start + e] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), v).to(q.dtype)
        start += e
    return out


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _tile(q, acc, m_i, l_i, n0, kv_end, q_pos, k_ptr, v_ptr, r2t_row, d, dmask, kvh, stride_ks, stride_kh, stride_vs,
          stride_vh, qk_scale, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):  # fmt: skip
    """One BLOCK_N tile of keys folded into the online softmax; MASKED: bounds and causality checked."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < kv_end
    if MASKED:
        slots = tl.load(r2t_row + n, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
    else:
        slots = tl.load(r2t_row + n).to(tl.int64)
        kv_mask = dmask[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)  # e4m3 KV to the query's dtype; float32 under the interpreter
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        # Key n is visible to query row m when n <= its position; column 0 always is, so no row is all -inf.
        qk = tl.where(nmask[None, :] & (n[None, :] <= q_pos[:, None]), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_blk"])  # the table's length varies per eager batch: one compile
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    r2t_ptr,
    rows_ptr,
    prefix_ptr,
    ext_ptr,
    qstart_ptr,
    blk_ptr,
    stride_blk,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t,
    qk_scale,
    o_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    entry = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(blk_ptr + entry)
    mb = tl.load(blk_ptr + stride_blk + entry)
    if b < 0:  # an unused entry of a fixed-size table
        return
    ext_len = tl.load(ext_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    q_start = tl.load(qstart_ptr + b).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    kvh = h // GROUP

    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < ext_len
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=mmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if F32_DOT:  # Triton's interpreter cannot multiply bf16 tiles
        q = q.to(tl.float32)
    q_pos = prefix + m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = prefix + tl.minimum(ext_len, (mb + 1) * BLOCK_M)
    # Keys before the block's first query position are visible to every row of it: those whole tiles need no
    # causal or bounds mask (most of a long prompt's tiles); only the tiles from there to kv_end are masked.
    open_end = (prefix + mb * BLOCK_M) // BLOCK_N * BLOCK_N
    for n0 in range(0, open_end, BLOCK_N):
        acc, m_i, l_i = _tile(q, acc, m_i, l_i, n0, kv_end, q_pos, k_ptr, v_ptr, r2t_ptr + row * stride_r2t, d,
                              dmask, kvh, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, False, BLOCK_N,
                              DOT_PREC)  # fmt: skip
    for n0 in range(open_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _tile(q, acc, m_i, l_i, n0, kv_end, q_pos, k_ptr, v_ptr, r2t_ptr + row * stride_r2t, d,
                              dmask, kvh, stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, True, BLOCK_N,
                              DOT_PREC)  # fmt: skip
    out = acc * (o_scale / l_i)[:, None]  # o_scale: an FP8 pool's V scale (the output is linear in V)
    tl.store(
        o_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mmask[:, None] & dmask[None, :],
    )


def extend_block_m(head_dim: int, on_cuda: bool) -> int:
    """Query rows per program: what a block table (`extend_blocks`) must be built for."""
    if INTERPRET or not on_cuda:
        return 16
    return 128 if head_dim <= 128 else 64


def extend_blocks(extend_lens, block_m: int) -> tuple[list[int], list[int]]:
    """The block table of a batch: (request index, block index within its new tokens) for every block."""
    reqs, blocks = [], []
    for i, n in enumerate(extend_lens):
        nb = -(-int(n) // block_m)
        reqs += [i] * nb
        blocks += range(nb)
    return reqs, blocks


def extend_attention(
    q,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    prefix_lens,
    extend_lens,
    q_starts,
    blocks: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, H, D]; prefix_lens/extend_lens/q_starts: [B] device tensors; blocks: [2, NB] device int tensor,
    the (request, block) table from `extend_blocks` for `extend_block_m`, request -1 marking unused entries.
    The new tokens' K/V must already be in the pool."""
    t, h, d = q.shape
    kvh = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    nb = blocks.shape[1]
    if t == 0 or nb == 0:
        return out
    block_d = next_pow2(d)
    block_m = extend_block_m(d, q.is_cuda)
    if INTERPRET or not q.is_cuda:
        block_n, warps, stages = 16, 4, 1
    else:
        block_n = 64 if d <= 128 else 32
        warps, stages = 8, 2
    _extend_kernel[(nb, h)](
        q,
        k_cache,
        v_cache,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        q_starts,
        blocks,
        blocks.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        sm_scale * k_scale * _LOG2E,
        v_scale,
        GROUP=h // kvh,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D=d,
        BLOCK_D=block_d,
        F32_DOT=INTERPRET,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out
