"""Per-token FP8 (e4m3) quantization of activations in one kernel: each program takes a row, finds its largest
magnitude, and writes the row in e4m3 with scale amax / 448 (and the scale). The torch reference is five kernels
(abs, amax, divide, clamp, cast) per projection: a whole decode step of them costs more than the GEMMs gain."""

from __future__ import annotations

import torch

from radixlm.kernels._triton import gdc_launch_dependents, gdc_wait, pdl_args, tl, triton

FP8_MAX = 448.0
MIN_SCALE = 1e-12


def quantize_tokens_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


# The per-token arithmetic every kernel that writes e4m3 rows shares (this one, the norm's and SiLU-and-mul's):
# one definition, so their values stay bit-identical.
@triton.jit
def row_scale(amax):
    """A row's scale from its largest magnitude: amax / 448, kept finite for an all-zero row."""
    return tl.maximum(amax / 448.0, 1e-12)


@triton.jit
def store_e4m3(ptrs, v, scale, mask):
    """v / scale, clamped into e4m3's range, stored at `ptrs` (e4m3)."""
    tl.store(ptrs, tl.minimum(tl.maximum(v / scale, -448.0), 448.0).to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_tokens_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, USE_PDL: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    if USE_PDL:
        # Launched while the kernel before it finishes; the matmul after it may launch at once and start
        # streaming its weights, and waits for this kernel's output itself.
        gdc_wait()
        gdc_launch_dependents()
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        # The whole row in registers: read once. At decode batch sizes this kernel is one program per row, so
        # its time is that program's latency, and a second pass over the row would double it.
        mask = offs < K
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(v), axis=0))
        tl.store(s_ptr + row, scale)
        store_e4m3(q_row + offs, v, scale, mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_row + k0 + offs, mask=(k0 + offs) < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = (k0 + offs) < K
            v = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            store_e4m3(q_row + k0 + offs, v, scale, mask)


# Rows up to this long are quantized in one pass (32 values a thread at most, 32 warps): every projection input
# of the Llama shapes up to 70B (hidden 8192, a tp-1 MLP row 28,672).
ONE_PASS_MAX = 32768


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, unit stride along K) -> (e4m3 [M, K], float32 scales [M, 1])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        one_pass = block <= ONE_PASS_MAX
        if not one_pass:
            block = 4096
        _quantize_tokens_kernel[(m,)](
            x,
            q,
            s,
            k,
            x.stride(0),
            q.stride(0),
            ONE_PASS=one_pass,
            BLOCK=block,
            num_warps=max(4, min(32, block // 1024)) if one_pass else 8,
            **pdl_args(x.device),
        )
    return q, s
