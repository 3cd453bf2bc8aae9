"""Flatten the rows of `req_to_token` a batch uses into one KV-index array (FlashInfer's page table with
page size 1): out[indptr[i] : indptr[i] + seq_lens[i]] = req_to_token[rows[i], :seq_lens[i]]."""

from __future__ import annotations

import torch

from radixlm.kernels._triton import tl, triton


def build_kv_indices_ref(req_to_token, rows, seq_lens, indptr, out) -> torch.Tensor:
    for i in range(rows.shape[0]):
        n, s = int(seq_lens[i]), int(indptr[i])
        out[s : s + n] = req_to_token[int(rows[i]), :n]
    return out


@triton.jit
def _kv_indices_kernel(r2t_ptr, rows_ptr, lens_ptr, indptr_ptr, out_ptr, stride_r2t, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b)
    dst = tl.load(indptr_ptr + b).to(tl.int64)
    for i in range(0, n, BLOCK):
        off = i + tl.arange(0, BLOCK)
        mask = off < n
        tl.store(out_ptr + dst + off, tl.load(r2t_ptr + row * stride_r2t + off, mask=mask), mask=mask)


def build_kv_indices(req_to_token, rows, seq_lens, indptr, out) -> torch.Tensor:
    """All device tensors; indptr[i] is where request i's indices start in `out`."""
    if rows.shape[0]:
        _kv_indices_kernel[(rows.shape[0],)](
            req_to_token, rows, seq_lens, indptr, out, req_to_token.stride(0), BLOCK=512, num_warps=4
        )
    return out
