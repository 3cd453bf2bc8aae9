"""Weight-holding building blocks. Parameters start uninitialised: every value comes from the checkpoint.
Layers that compute through a kernel hold the runner's `KernelOps` set in `ops` (torch references by default)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.srt.distributed.parallel import PartialSum
from radixlm.srt.layers.ops import TORCH_OPS


class QuantizedMatmul(Protocol):
    """A weight kept in another form than `Linear.weight` (srt/layers/quantization/): x @ W.T in x's dtype."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


_DEFERRED = contextvars.ContextVar("linear_weights_deferred", default=False)


@contextlib.contextmanager
def deferred_linear_weights() -> Iterator[None]:
    """Linears built inside get their weight on the meta device (a shape, no memory): the loader then gives each
    one its real form (srt/layers/quantization/fp8_load.py), never holding the whole model in another."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        device = "meta" if _DEFERRED.get() else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.ops = TORCH_OPS
        # Set by the loader for quantized checkpoints; `weight` is then an empty placeholder.
        self.quant: QuantizedMatmul | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.product(x)
            return y if self.bias is None else y + self.bias
        return self.ops.linear(x, self.weight, self.bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T without the bias."""
        if self.quant is not None:
            # FP8 weights go through the op set, which picks a GEMV for small batches; other forms compute alone
            return self.ops.fp8_linear(x, self.quant) if getattr(self.quant, "scaled", False) else self.quant.matmul(x)
        return self.ops.linear(x, self.weight, None)


class QuantizedRows(Protocol):
    """An embedding table kept in another form than `Embedding.weight`: rows dequantized on lookup."""

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)
        # Set by the loader for quantized checkpoints; `weight` is then an empty placeholder of the run dtype.
        self.quant: QuantizedRows | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.lookup(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor | PartialSum, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and also returns the sum (the next residual). The fused kernels
        may overwrite x and residual in place: callers pass tensors they no longer need. A PartialSum (a
        row-parallel projection's share) is summed across ranks first, in the norm's kernel where one exists."""
        if isinstance(x, PartialSum):
            done = self._fused(x, residual, quant=False)
            if done is not None:
                return done
            x = x.reduced()
        if residual is None:
            return self.ops.rmsnorm(x, self.weight, self.eps)
        return self.ops.fused_add_rmsnorm(x, residual, self.weight, self.eps)

    def before(self, proj: Linear, x: torch.Tensor, residual: torch.Tensor | None):
        """The norm feeding `proj`: (its input, the residual stream). For an FP8 projection (e4m3 rows with
        per-row scales) the op set's kernel may hand over rows already quantized per token (Fp8Rows), which
        the FP8 paths take as they are. Without `residual`, x itself is the residual stream."""
        quant = self.ops.rmsnorm_fp8 is not None and getattr(proj.quant, "scaled", False)
        if isinstance(x, PartialSum):
            done = self._fused(x, residual, quant)
            if done is not None:
                return done
            x = x.reduced()
        if quant and x.dim() == 2:
            return self.ops.rmsnorm_fp8(x, residual, self.weight, self.eps)
        if residual is None:
            return self.forward(x), x
        return self.forward(x, residual)

    def _fused(self, part: PartialSum, residual: torch.Tensor | None, quant: bool):
        """One kernel for the all-reduce of `part`, the residual add, this norm, and the e4m3 rows of an FP8
        projection with `quant`: (rows, residual) as `before` returns them; None where the group has no such
        kernel, there is no residual or the rows do not fit (the caller then all-reduces and takes its own path)."""
        fused = part.tp.fused
        if fused is None or residual is None or not fused.takes(part.x):
            return None
        if quant:
            from radixlm.srt.layers.quantization.fp8 import Fp8Rows

            q, scale, residual = fused(part.x, residual, self.weight, self.eps, quant=True)
            return Fp8Rows(q, scale, part.x.dtype), residual
        return fused(part.x, residual, self.weight, self.eps)
