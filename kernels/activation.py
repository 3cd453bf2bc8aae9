"""SiLU(gate) * up over the fused gate_up projection's output; or that written straight in e4m3 with a scale per
token for an FP8 down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.kernels._triton import tl, triton
from radixlm.kernels.fp8_quant import quantize_tokens_ref, row_scale, store_e4m3


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _act(x_row, cols, mask, n_cols):
    """silu(gate) * up at `cols` of a gate_up row, rounded to the row's dtype as the torch reference rounds it
    (silu(gate) first, then the product), in float32."""
    ty = x_row.dtype.element_ty
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    return (act * up).to(ty).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = _act(x_ptr + row * stride_x, cols, mask, n_cols)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * N] -> [T, N]."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = 1024
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows [T, N], float32 scales [T, 1]) of silu_and_mul(x), as `silu_and_mul_fp8`."""
    return quantize_tokens_ref(silu_and_mul_ref(x))


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, n_cols, ONE_PASS: tl.constexpr,
                             BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < n_cols
        y = _act(x_row, offs, mask, n_cols)
        scale = row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(s_ptr + row, scale)
        store_e4m3(q_row + offs, y, scale, mask)
    else:  # the row is computed twice (once for its largest value, once to store it): no bf16 copy kept
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            amax = tl.maximum(amax, tl.abs(_act(x_row, c0 + offs, (c0 + offs) < n_cols, n_cols)))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for c0 in range(0, n_cols, BLOCK):
            mask = (c0 + offs) < n_cols
            store_e4m3(q_row + c0 + offs, _act(x_row, c0 + offs, mask, n_cols), scale, mask)


# Rows of up to this many products are computed once, in registers (a 70B MLP row at tp 2 and above, 8B at tp 1);
# longer ones twice.
ONE_PASS_MAX = 16384


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2 * N] -> silu(gate) * up as e4m3 rows [T, N] with float32 scales [T, 1] for an FP8 projection:
    exactly `silu_and_mul` followed by `fp8_quant.quantize_tokens`, in one kernel and without the bf16 rows."""
    n = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(x.shape[0], n, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(n)
        one_pass = block <= ONE_PASS_MAX
        if not one_pass:
            block = 4096
        _silu_and_mul_fp8_kernel[(x.shape[0],)](
            x,
            q,
            s,
            x.stride(0),
            q.stride(0),
            n,
            ONE_PASS=one_pass,
            BLOCK=block,
            num_warps=max(4, min(16, block // 1024)),
        )
    return q, s
