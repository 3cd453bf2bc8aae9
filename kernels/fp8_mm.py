"""FP8 matmuls on the tensor cores for decode-sized batches: y = (x quantized per token) @ W.T with W [N, K] in
e4m3 and one float32 scale per row (W8A8, the scaled GEMM's arithmetic).

The CUDA-core GEMV (`gemv.py`) converts every e4m3 weight to fp32 before its FMA: at one byte per weight the
conversion, not HBM, bounds it. Here the weight tile goes to the tensor cores as it is, with the weights as the
MMA's tall operand ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M], the batch padded to 16 rows), so the loop is loads
and MMAs. For small batches the kernel also quantizes x itself (each program finds the rows' amax in a first
pass over x, which sits in L2, then quantizes its tiles on the fly): the separate quantization kernel and its
launch go away. `silu_mul` fuses the MLP activation into the gate_up projection as the GEMV does.
"""

from __future__ import annotations

import torch

from radixlm.kernels._triton import gdc_launch_dependents, gdc_wait, pdl_args, tl, triton

FUSED_QUANT_MAX_M = 16  # above this every program re-reading x for its amax costs more than a separate kernel


@triton.jit
def _load_tile(ptrs, k0, K, rk, row_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs + k0, mask=row_mask[:, None], other=0.0)
    return tl.load(ptrs + k0, mask=row_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0)


@triton.jit
def _fp8_mm_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    up_offset,
    X_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    u_rows = w_rows + up_offset * stride_wn  # SILU_MUL: the up rows sit `up_offset` rows below the gate rows
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    # The weights do not depend on the kernel before this one: start their stream before waiting for it (PDL).
    w = _load_tile(w_rows, 0, K, rk, n_mask, EVEN_K)
    if SILU_MUL:
        u = _load_tile(u_rows, 0, K, rk, n_mask, EVEN_K)
    if USE_PDL:
        gdc_wait()
    if X_FP8:
        xs = tl.load(xs_ptr + rm, mask=m_mask, other=1.0)
    else:  # per-token scale as quantize_tokens computes it: amax / 448
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = _load_tile(x_rows, k0, K, rk, m_mask, EVEN_K).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        xs = tl.maximum(amax / 448.0, 1e-12)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if k0 > 0:
            w = _load_tile(w_rows, k0, K, rk, n_mask, EVEN_K)
            if SILU_MUL:
                u = _load_tile(u_rows, k0, K, rk, n_mask, EVEN_K)
        if X_FP8:
            xq = _load_tile(x_rows, k0, K, rk, m_mask, EVEN_K)
        else:
            v = _load_tile(x_rows, k0, K, rk, m_mask, EVEN_K).to(tl.float32)
            xq = tl.minimum(tl.maximum(v / xs[:, None], -448.0), 448.0).to(w_ptr.dtype.element_ty)
        xt = tl.trans(xq)
        acc = tl.dot(w, xt, acc)
        if SILU_MUL:
            acc_up = tl.dot(u, xt, acc_up)
    if USE_PDL:
        gdc_launch_dependents()
    out_ty = out_ptr.dtype.element_ty
    y = acc * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)[:, None] * xs[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        up = acc_up * tl.load(ws_ptr + up_offset + rn, mask=n_mask, other=0.0)[:, None] * xs[None, :]
        if HAS_BIAS:
            up += tl.load(b_ptr + up_offset + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        # Round as the unfused path does: projection to the activation dtype, silu to it, then the product.
        gate = y.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        y = act * up.to(out_ty).to(tl.float32)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ty), mask=n_mask[:, None] & m_mask[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) candidates per batch bucket; the tuner times them per shape against
# the scaled GEMM and the GEMV. BLOCK_N 64 per warpgroup is Hopper's MMA height.
CONFIGS: dict[int, list[tuple[int, int, int, int]]] = {
    16: [(64, 256, 4, 4), (64, 128, 4, 6), (64, 512, 4, 3), (128, 256, 8, 4), (64, 256, 4, 6), (32, 256, 4, 4)],
    32: [(64, 256, 4, 4), (64, 128, 4, 5), (128, 128, 8, 4), (128, 256, 8, 3)],
    64: [(64, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 3)],
    128: [(128, 128, 8, 4), (64, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3)],
}


def bucket(m: int) -> int:
    """The batch bucket (and BLOCK_M) a batch of m rows runs in."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def fp8_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    silu_mul: bool = False,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] in bf16/fp16 (quantized per token inside the kernel; or, with `x_scale` [M] / [M, 1], already
    e4m3), w [N, K] e4m3 with `scale` [N] float32 -> [M, N] in x's dtype (bf16 for e4m3 x). `silu_mul`: w holds
    gate rows then up rows and the result is silu(gate) * up, [M, N / 2]."""
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    x_fp8 = x_scale is not None
    if not x_fp8 and m > FUSED_QUANT_MAX_M:
        from radixlm.kernels.fp8_quant import quantize_tokens  # noqa: PLC0415

        x_dtype = x.dtype
        x, x_scale = quantize_tokens(x)
        x_fp8 = True
    else:
        x_dtype = torch.bfloat16 if x_fp8 else x.dtype
    block_n, block_k, warps, stages = config or CONFIGS[bucket(m)][0]
    if silu_mul and block_n > 64:
        block_n //= 2  # two accumulators
    block_m = min(bucket(m), 64) if m > 16 else 16
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _fp8_mm_kernel[grid](
        x,
        x_scale.reshape(-1) if x_fp8 else scale,
        w,
        scale.reshape(-1),
        bias if bias is not None else scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        n,
        X_FP8=x_fp8,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        EVEN_K=k % block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x.device),
    )
    return out
