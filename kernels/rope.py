"""Rotary embedding (rotate-half layout) fused with the K/V store into the paged pool.

One program per token: it rotates the token's query heads into `q_out`, and writes its rotated key heads and
its value heads straight into the pool at the token's KV slot, so K and V never take a round trip through
memory between the projection and the cache. Optionally applies Qwen3's per-head RMSNorm to q and k first.
Every rope scaling we support (default, linear, llama3) lives in the cos/sin table, so one kernel serves all.
"""

from __future__ import annotations

import torch

from radixlm.kernels import next_pow2
from radixlm.kernels._triton import tl, triton

FP8_MAX = 448.0


# --- torch reference -----------------------------------------------------------------------------------------
def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D/2] float32."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _head_rmsnorm_ref(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the cache's dtype: an e4m3 cache stores x / scale, saturated at e4m3's largest value."""
    if cache.dtype == torch.float8_e4m3fn:
        return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return x.to(cache.dtype)


def store_rows(cache: torch.Tensor, loc: torch.Tensor, x: torch.Tensor) -> None:
    """cache[loc] = x (x in the cache's dtype); e4m3 rows are copied as bytes, which every device's
    index_copy_ handles."""
    if cache.dtype == torch.float8_e4m3fn:
        cache.view(torch.uint8).index_copy_(0, loc, x.view(torch.uint8))
    else:
        cache.index_copy_(0, loc, x)


def gather_rows(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, idx), e4m3 rows read as bytes."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).index_select(0, idx).view(cache.dtype)
    return cache.index_select(0, idx)


def rope_and_store_ref(
    positions,
    q,
    k,
    v,
    cos_sin,
    k_cache,
    v_cache,
    loc,
    q_norm_weight=None,
    k_norm_weight=None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Returns the rotated q [T, H, D]; writes rotated k and v into k_cache/v_cache [slots, KVH, D] at `loc`
    (an e4m3 cache holds them divided by `k_scale` / `v_scale`)."""
    if q_norm_weight is not None:
        q, k = _head_rmsnorm_ref(q, q_norm_weight, eps), _head_rmsnorm_ref(k, k_norm_weight, eps)
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).unsqueeze(1)
    cos, sin = cs[..., :half], cs[..., half:]
    q, k = apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
    store_rows(k_cache, loc, to_cache(k, k_cache, k_scale))
    store_rows(v_cache, loc, to_cache(v, v_cache, v_scale))
    return q


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _rope_heads(
    x_ptr,
    stride_h,
    n_heads,
    cos,
    sin,
    nw_ptr,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Loads [n_heads, 2 * HALF] at x_ptr, returns the two rotated halves in float32."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < n_heads) & (d[None, :] < HALF)
    off = h[:, None] * stride_h + d[None, :]
    x1 = tl.load(x_ptr + off, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + off + HALF, mask=mask, other=0.0)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(nw_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(nw_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = (f1 * rstd[:, None]).to(x1.dtype).to(tl.float32) * w1[None, :]
        x2 = (f2 * rstd[:, None]).to(x2.dtype).to(tl.float32) * w2[None, :]
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :], off, mask


@triton.jit
def _rope_store_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cs_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    loc_ptr,
    qn_ptr,
    kn_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_qot,
    stride_qoh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    n_heads,
    n_kv_heads,
    eps,
    k_inv,
    v_inv,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=d < HALF, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0)

    q1, q2, _, qmask = _rope_heads(
        q_ptr + t * stride_qt, stride_qh, n_heads, cos, sin, qn_ptr, eps, HALF, BLOCK_H, BLOCK_HALF, HAS_NORM
    )
    hq = tl.arange(0, BLOCK_H)
    qo = qo_ptr + t * stride_qot + hq[:, None] * stride_qoh + d[None, :]
    tl.store(qo, q1.to(qo_ptr.dtype.element_ty), mask=qmask)
    tl.store(qo + HALF, q2.to(qo_ptr.dtype.element_ty), mask=qmask)

    k1, k2, _, kmask = _rope_heads(
        k_ptr + t * stride_kt, stride_kh, n_kv_heads, cos, sin, kn_ptr, eps, HALF, BLOCK_KVH, BLOCK_HALF, HAS_NORM
    )
    hk = tl.arange(0, BLOCK_KVH)
    kc = kc_ptr + slot * stride_kcs + hk[:, None] * stride_kch + d[None, :]
    if KV_FP8:  # an e4m3 pool holds K / k_scale, saturated
        k1 = tl.minimum(tl.maximum(k1 * k_inv, -448.0), 448.0)
        k2 = tl.minimum(tl.maximum(k2 * k_inv, -448.0), 448.0)
    tl.store(kc, k1.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(kc + HALF, k2.to(kc_ptr.dtype.element_ty), mask=kmask)

    voff = hk[:, None] * stride_vh + d[None, :]
    vc = vc_ptr + slot * stride_vcs + hk[:, None] * stride_vch + d[None, :]
    v1 = tl.load(v_ptr + t * stride_vt + voff, mask=kmask, other=0.0)
    v2 = tl.load(v_ptr + t * stride_vt + voff + HALF, mask=kmask, other=0.0)
    if KV_FP8:
        v1 = tl.minimum(tl.maximum(v1.to(tl.float32) * v_inv, -448.0), 448.0)
        v2 = tl.minimum(tl.maximum(v2.to(tl.float32) * v_inv, -448.0), 448.0)
    tl.store(vc, v1.to(vc_ptr.dtype.element_ty), mask=kmask)
    tl.store(vc + HALF, v2.to(vc_ptr.dtype.element_ty), mask=kmask)


def rope_and_store(
    positions,
    q,
    k,
    v,
    cos_sin,
    k_cache,
    v_cache,
    loc,
    q_norm_weight=None,
    k_norm_weight=None,
    eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] (strided views of the qkv projection are fine); cos_sin: [P, D] float32
    (cos | sin halves); k_cache/v_cache: [slots, KVH, D] (e4m3: K / k_scale and V / v_scale); loc: [T] KV
    slots. Returns rotated q, contiguous."""
    t, h, d = q.shape
    assert d % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    has_norm = q_norm_weight is not None
    kvh = k.shape[1]
    _rope_store_kernel[(t,)](
        positions,
        q,
        k,
        v,
        cos_sin,
        q_out,
        k_cache,
        v_cache,
        loc,
        q_norm_weight if has_norm else cos_sin,
        k_norm_weight if has_norm else cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        h,
        kvh,
        eps,
        1.0 / k_scale,
        1.0 / v_scale,
        HALF=d // 2,
        BLOCK_HALF=next_pow2(d // 2),
        BLOCK_H=next_pow2(h),
        BLOCK_KVH=next_pow2(kvh),
        HAS_NORM=has_norm,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )
    return q_out
