"""GGUF Q8_0 embedding rows kept 8-bit: blocks of 32 int8 q with one fp16 scale d, w = d * q.

A lookup dequantizes only the rows it reads. fp16 d (11-bit mantissa) times int8 q fits fp32's 24 bits, so
the rows are bit-identical to the dequantized fp32 table, at a quarter of its memory (30 MB, not 113 MB, for
SmolLM2's 49152 x 576)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixlm.kernels.cpu import q8_gemm

GROUP = 32
_BLOCK_BYTES = 34


@dataclass
class Q8Rows:
    q: torch.Tensor  # [V, K] int8
    d: torch.Tensor  # [V, K/32] float32

    @classmethod
    def from_gguf(cls, data: np.ndarray, n: int, k: int) -> "Q8Rows":
        b = np.asarray(data).reshape(n, k // GROUP, _BLOCK_BYTES)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        return cls(torch.from_numpy(q), torch.from_numpy(d))

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, k = ids.numel(), self.q.shape[1]
        flat = ids.reshape(-1)
        rows = self.q.index_select(0, flat).view(n, k // GROUP, GROUP).to(torch.float32)
        rows = rows * self.d.index_select(0, flat).unsqueeze(-1)
        return rows.view(*ids.shape, k).to(dtype)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        q, d = self.q[start:end], self.d[start:end]
        return (q.view(q.shape[0], -1, GROUP).float() * d.unsqueeze(-1)).view(q.shape)

    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes


@dataclass
class Q8Linear:
    """x @ W.T straight from Q8_0 blocks (the tied lm_head shares the embedding's Q8Rows: no second copy) with
    our C kernel (kernels/cpu.py q8_gemm): fp32 activations, exact weights, fp32 sums and output."""

    rows: Q8Rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = q8_gemm(self.rows.q, self.rows.d, x.reshape(-1, shape[-1]).float())
        return y.to(x.dtype).view(*shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        return 0  # the embedding's blocks
