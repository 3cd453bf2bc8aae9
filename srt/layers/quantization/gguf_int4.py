"""GGUF Q4_0 / Q4_1 weights kept as 4-bit blocks and run through torch's int4 CPU matmul.

Both types are blocks of 32 weights along K with one fp16 scale d (and for Q4_1 one fp16 offset m):
Q4_0 w = d * (q - 8), Q4_1 w = d * q + m, q in 0..15. torch's `_weight_int4pack_mm_for_cpu` computes
w = (q - 8) * scale + zero per group of 32, so both map exactly: scale = d, zero = 0 (Q4_0) or m + 8d (Q4_1).
Only its bf16 path is vectorized (fp32 input falls back to scalar code ~30-100x slower), so `matmul` runs the
product in bf16 and hands back the caller's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32  # weights per GGUF block, and the group size we give the int4 op
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


@dataclass
class Q4Blocks:
    """One GGUF tensor's blocks split into parts: nibbles q [N, K] (uint8, 0..15) and per-block scale d and
    offset m [N, K/32] (float32; for Q4_0 m = -8d). numpy arrays, not tensors: torch's small elementwise ops
    (uint8 and/shift/cat, dtype casts) ran ~50x slower than numpy's here and dominated the load time."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray

    @classmethod
    def from_gguf(cls, data: np.ndarray, kind: str, n: int, k: int) -> "Q4Blocks":
        nbytes = _BLOCK_BYTES[kind]
        b = np.asarray(data).reshape(n, k // GROUP, nbytes)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        else:
            m = -8 * d  # so that d * q + m is Q4_0's d * (q - 8)
        qs = b[..., nbytes - 16 :]
        # byte j holds element j in its low nibble and element j + 16 in its high nibble
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)
        return cls(q, d, m)

    def map_rows(self, fn) -> "Q4Blocks":
        """Apply a row permutation (the loader's rotary unpermute) to every part alike: blocks run along K,
        so whole rows move with their scales."""
        return Q4Blocks(*(np.ascontiguousarray(fn(a)) for a in (self.q, self.d, self.m)))

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.reshape(n, k // GROUP, GROUP).astype(np.float32) * self.d[..., None] + self.m[..., None]
        return torch.from_numpy(w.reshape(n, k))

    @staticmethod
    def cat(parts: list["Q4Blocks"]) -> "Q4Blocks":
        """Stack along N (fused projections: qkv, gate_up)."""
        return Q4Blocks(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("q", "d", "m")))


def scales_and_zeros(blocks: Q4Blocks, dtype: torch.dtype) -> torch.Tensor:
    """The op's [K/32, N, 2] (scale, zero) table in the activation dtype. In bf16 the fp16 scales lose 3 bits
    of mantissa: that rounding, with bf16 activations, is the whole error of the fast path (fp32 is exact)."""
    table = np.ascontiguousarray(np.stack([blocks.d.T, (blocks.m + 8 * blocks.d).T], axis=-1))
    if dtype == torch.bfloat16:  # numpy rounding, for load time as in Q4Blocks
        return torch.from_numpy(_to_bf16_bits(table)).view(torch.bfloat16)
    return torch.from_numpy(table).to(dtype)


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (as torch's .to(bfloat16); finite inputs)."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@dataclass
class Int4Linear:
    """x @ W.T on a packed int4 weight: `packed` [N, K/2] uint8 in the op's layout, `scales_zeros`
    [K/32, N, 2] bf16 (scale, zero) per group."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks) -> "Int4Linear":
        n, k = blocks.q.shape
        if n % 16 or k % GROUP:
            raise ValueError(f"int4 CPU matmul needs N % 16 == 0 and K % 32 == 0, got {n}x{k}")
        q32 = torch.from_numpy(blocks.q.astype(np.int32))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1)
        return cls(packed, scales_and_zeros(blocks, torch.bfloat16), n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


@dataclass
class Q4DotLinear:
    """x @ W.T on the GGUF blocks through our C kernel (kernels/cpu.py q4_gemm: AVX-512 BF16 dot products or
    AVX2 FMAs, 16 output rows per tile, the block scales applied once per 32 k). The nibbles and fp16 d, m
    are exact; x is rounded to bf16 as for torch's int4 op, whose bf16 scales it does not need. 1.5-1.9x
    faster than that op on SmolLM2's shapes at 1, 16 and 128 rows on AVX-512 BF16, 1.7-2.3x at 1, 4, 16 and
    128 rows on AVX2 (one thread); `Int4Linear` where the CPU has neither."""

    qs: torch.Tensor  # [N/16, K/32, 16, 16] uint8
    dm: torch.Tensor  # [N/16, K/32, 2, 16] fp16
    out_features: int
    in_features: int

    @classmethod
    def from_blocks(cls, blocks: Q4Blocks) -> "Q4DotLinear":
        from radixlm.kernels.cpu import q4_pack

        n, k = blocks.q.shape
        return cls(*q4_pack(blocks.q, blocks.d, blocks.m), n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from radixlm.kernels.cpu import q4_gemm

        shape = x.shape
        y = q4_gemm(self.qs, self.dm, x.reshape(-1, self.in_features).float(), self.out_features, self.in_features)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.dm.nbytes


@dataclass
class SplitBf16Linear:
    """A weight run as two bf16 GEMMs, w = hi + lo (the tied lm_head, Q8_0 in the file). oneDNN's bf16 GEMM
    on AVX-512 BF16 is ~3x faster than fp32 at batch 1, but one bf16 copy of the head (8-bit mantissa) flips
    the first greedy token of the France prompt; hi + lo keeps ~16 bits, and the greedy answers then match
    the fp32 head's. Two passes over half-size weights still beat one fp32 pass."""

    hi: torch.Tensor
    lo: torch.Tensor

    @classmethod
    def from_rows(
        cls, rows: Callable[[int, int], torch.Tensor], n: int, k: int, chunk: int = 4096
    ) -> "SplitBf16Linear":
        """From fp32 row ranges `rows(start, end)`, by chunks: a whole fp32 table and its temporaries would add
        several hundred MB to the load's peak."""
        hi = torch.empty(n, k, dtype=torch.bfloat16)
        lo = torch.empty(n, k, dtype=torch.bfloat16)
        for start in range(0, n, chunk):
            w = rows(start, min(start + chunk, n)).float()
            hi[start : start + chunk] = w
            lo[start : start + chunk] = w - hi[start : start + chunk].float()
        return cls(hi, lo)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        return F.linear(xb, self.hi).to(x.dtype) + F.linear(xb, self.lo).to(x.dtype)

    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes
