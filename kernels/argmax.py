"""Row argmax over the vocabulary (greedy sampling), in two passes: chunk maxima, then one merge per row.

torch's argmax over a [B, 128256] float32 row runs as one reduction per row: tens of us at batch 1, a few
percent of a batch-1 decode step. Splitting each row into chunks fills the GPU;
ties resolve to the lowest index, as torch's do.
"""

from __future__ import annotations

import torch

from radixlm.kernels._triton import tl, triton

BLOCK = 4096


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(-1)


@triton.jit
def _argmax_chunks(x_ptr, val_ptr, idx_ptr, stride_x, n_cols, n_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN counts as +inf (torch picks a NaN over everything)
    m = tl.max(x, 0)
    # the lowest column holding the maximum; every chunk has a column < n_cols, so an all -inf one picks it
    i = tl.min(tl.where(x == m, cols, n_cols), 0)
    tl.store(val_ptr + row * n_chunks + c, m)
    tl.store(idx_ptr + row * n_chunks + c, i)


@triton.jit
def _argmax_merge(val_ptr, idx_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    mask = c < n_chunks
    v = tl.load(val_ptr + row * n_chunks + c, mask=mask, other=float("-inf"))
    i = tl.load(idx_ptr + row * n_chunks + c, mask=mask, other=2147483647)
    m = tl.max(v, 0)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (v == m), i, 2147483647), 0).to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [B, V] (unit stride in V) -> [B] int64, the first index of each row's maximum."""
    b, n = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    chunks = triton.cdiv(n, BLOCK)
    vals = torch.empty(b, chunks, dtype=torch.float32, device=x.device)
    idxs = torch.empty(b, chunks, dtype=torch.int32, device=x.device)
    _argmax_chunks[(b, chunks)](x, vals, idxs, x.stride(0), n, chunks, BLOCK=BLOCK, num_warps=8)
    _argmax_merge[(b,)](vals, idxs, out, chunks, BLOCK_C=max(16, 1 << (chunks - 1).bit_length()), num_warps=1)
    return out
