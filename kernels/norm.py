"""RMSNorm, and RMSNorm with the residual add fused in (one read of x and residual, one write of each); either
can write its rows straight in e4m3 with a scale per token for an FP8 projection (one kernel instead of a norm
and a quantization launch, and no bf16 rows written and read back between them)."""

from __future__ import annotations

import torch

from radixlm.kernels import next_pow2
from radixlm.kernels._triton import gdc_launch_dependents, gdc_wait, pdl_args, tl, triton
from radixlm.kernels.fp8_quant import quantize_tokens_ref, row_scale, store_e4m3


# --- torch references ----------------------------------------------------------------------------------------
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rmsnorm(x + residual), x + residual)."""
    s = x + residual
    return rmsnorm_ref(s, weight, eps), s


def rmsnorm_fp8_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(e4m3 rows, float32 scales [T, 1], residual stream) of rmsnorm(x [+ residual]), as `rmsnorm_fp8`."""
    y, res = (rmsnorm_ref(x, weight, eps), x) if residual is None else fused_add_rmsnorm_ref(x, residual, weight, eps)
    return (*quantize_tokens_ref(y), res)


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if USE_PDL:
        # The kernel after this one may launch now (it waits for our output before reading it), and this one
        # was launched before the kernel ahead of it finished: it waits for that kernel's output here, instead
        # of starting only after it (profiled decode steps showed a launch gap before every norm otherwise).
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first: the residual stream is kept in that dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    norm_row_store(x, w_ptr, out_ptr, q_ptr, s_ptr, row, stride_out, cols, mask, n_cols, eps, QUANT)


@triton.jit
def norm_row_store(x, w_ptr, out_ptr, q_ptr, s_ptr, row, stride_out, cols, mask, n_cols, eps, QUANT: tl.constexpr):
    """RMSNorm of one row x (the activation dtype) stored at `out_ptr`'s row, or in e4m3 at `q_ptr`'s row with
    its scale at `s_ptr + row`: the epilogue every norm kernel shares, so their values stay bit-identical."""
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    if QUANT:
        # Exactly what quantizing the stored rows (fp8_quant.quantize_tokens) computes: the row rounded to the
        # activation dtype first, then amax / 448 as its scale; greedy answers do not change with the fusion.
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(s_ptr + row, scale)
        store_e4m3(q_ptr + row * stride_out + cols, y, scale, mask)
    else:
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, q=None, scale=None):
    n = x.shape[-1]
    block = next_pow2(n)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _rmsnorm_kernel[(x.shape[0],)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        q if q is not None else out,
        scale if scale is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        (q if q is not None else out).stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        QUANT=q is not None,
        BLOCK=block,
        num_warps=warps,
        **pdl_args(x.device),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] with unit stride in the last dim."""
    out = torch.empty_like(x)
    if x.shape[0]:
        _launch(x, None, weight, eps, out)
    return out


def fused_add_rmsnorm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """In place: residual <- x + residual, x <- rmsnorm(residual). Returns (x, residual)."""
    if x.shape[0]:
        _launch(x, residual, weight, eps, x)
    return x, residual


def rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rmsnorm(x [+ residual]) as e4m3 rows [T, N] with float32 scales [T, 1] (quantize_tokens' values), and the
    residual stream: residual <- x + residual in place, or x itself when there is none."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        # `out` only names the activation dtype the rows are rounded to; nothing is written to it
        _launch(x, residual, weight, eps, x, q, scale)
    return q, scale, (x if residual is None else residual)
