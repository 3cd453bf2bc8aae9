"""Filling a model whose linears run in FP8 (`--quantization fp8`).

The model is built with its linear weights deferred (`deferred_linear_weights`: no memory behind them), so a
model whose bf16 weights would not fit the device (a 70B one on an 80 GB GPU) still loads: each projection is
quantized as its tensors stream in and only its e4m3 form is kept. Shards of a fused projection (q, k, v into
qkv; gate and up) fill their rows of the fused weight: per-channel scales make the rows independent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixlm.srt.layers.basic import Linear
from radixlm.srt.layers.quantization.fp8 import FP8, Fp8Linear, dequantize_rows, quantize_rows

logger = logging.getLogger(__name__)

Tensors = Iterable[tuple[str, "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]]


def fp8_linears(model: nn.Module, head: bool, skip: frozenset[str] = frozenset()) -> dict[str, Linear]:
    """The linears that run in FP8: every projection of the decoder layers, and the untied LM head with `head`;
    `skip`: module names (or their last part) a checkpoint keeps unquantized."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name in skip or name.rpartition(".")[2] in skip:
            continue
        if name == "lm_head" and not head:
            continue
        out[name] = module
    return out


def materialize_others(
    model: nn.Module, quantized: dict[str, Linear], dtype: torch.dtype, device: torch.device
) -> None:
    """Give the deferred weights of the linears that stay in `dtype` (an LM head kept bf16) their memory."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name not in quantized and module.weight.is_meta:
            module.weight = nn.Parameter(
                torch.empty(module.weight.shape, dtype=dtype, device=device), requires_grad=False
            )


def load_fp8(
    model: nn.Module,
    tensors: Tensors,
    quantized: dict[str, Linear],
    dtype: torch.dtype,
    device: torch.device,
    sliced: bool = False,
) -> None:
    """Fill `model` from checkpoint tensors: the linears in `quantized` in FP8 (a bf16 tensor is quantized per
    output channel, an FP8 checkpoint's (e4m3, scales) pair is taken as is), the rest in `dtype`. `sliced`: the
    tensors are this tensor-parallel rank's parts already (model.rank_rows)."""
    building: dict[str, list] = {}  # target -> [e4m3 weight, scales, shards left]
    targets = {f"{name}.weight" for name in quantized}

    def others() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors:
            target, shard, count = model.checkpoint_target(name)
            if target not in targets:
                yield name, (dequantize_rows(*t).to(dtype) if isinstance(t, tuple) else t.to(dtype))
                continue
            module = quantized[target.rpartition(".")[0]]
            n, k = module.weight.shape
            q, s = t if isinstance(t, tuple) else quantize_rows(t.to(device))
            lo, hi = (0, n) if shard is None else model.shard_rows(target, shard)
            if tuple(q.shape) != (hi - lo, k):
                from radixlm.srt.errors import ModelLoadError  # noqa: PLC0415

                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(q.shape)}, expected {(hi - lo, k)}",
                    param="model_path",
                )
            entry = building.setdefault(
                target,
                [
                    torch.empty(n, k, dtype=FP8, device=device),
                    torch.empty(n, dtype=torch.float32, device=device),
                    count,
                ],
            )
            entry[0][lo:hi] = q.to(device)
            entry[1][lo:hi] = s.to(device)
            entry[2] -= 1
            if entry[2] == 0:
                _install(module, Fp8Linear(entry[0], entry[1]), dtype, device)
                del building[target]

    model.load_weights(others(), prefilled=frozenset(targets), sliced=sliced)
    if building:
        from radixlm.srt.errors import ModelLoadError  # noqa: PLC0415

        raise ModelLoadError(f"checkpoint is missing shards of {', '.join(sorted(building))}", param="model_path")


def random_fp8(
    model: nn.Module, quantized: dict[str, Linear], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> None:
    """Random weights (`--load-format dummy`): each FP8 linear from a random bf16 matrix, one at a time."""
    for module in quantized.values():
        w = torch.empty(module.weight.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        _install(module, Fp8Linear.from_weight(w), dtype, device)
        del w


def fp8_tied_head(model: nn.Module) -> None:
    """A head tied to the embedding, in FP8 beside the bf16 table the embedding keeps reading."""
    model.lm_head_quant = Fp8Linear.from_weight(model.model.embed_tokens.weight.detach())


def _install(module: Linear, quant: Fp8Linear, dtype: torch.dtype, device: torch.device) -> None:
    module.quant = quant
    module.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)


def summary(model: nn.Module) -> str:
    linears = [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.quant, Fp8Linear)]
    head = (
        "fp8"
        if isinstance(getattr(model, "lm_head_quant", None), Fp8Linear)
        or any(isinstance(getattr(m, "quant", None), Fp8Linear) for n, m in model.named_modules() if n == "lm_head")
        else "bf16"
    )
    return (
        f"fp8: {len(linears)} linears in e4m3 ({sum(m.quant.nbytes() for m in linears) / 2**30:.2f} GiB), "
        f"LM head {head}"
    )
