"""RMSNorm, and RMSNorm with the residual add fused in (one read of x and residual, one write of each)."""

from __future__ import annotations

import torch

from radixlm.kernels import next_pow2
from radixlm.kernels._triton import gdc_launch_dependents, pdl_enabled, tl, triton


# --- torch references ----------------------------------------------------------------------------------------
def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rmsnorm(x + residual), x + residual)."""
    s = x + residual
    return rmsnorm_ref(s, weight, eps), s


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if PDL_TRIGGER:  # a kernel launched after this one may start now: it waits for our output before reading it
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype first: the residual stream is kept in that dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out):
    n = x.shape[-1]
    block = next_pow2(n)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _rmsnorm_kernel[(x.shape[0],)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        PDL_TRIGGER=pdl_enabled(x.device),
        BLOCK=block,
        num_warps=warps,
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
