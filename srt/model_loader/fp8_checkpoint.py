"""FP8 checkpoints as users download them: which format a `config.json` names, and its tensors with every e4m3
weight paired with its scales (see srt/layers/quantization/fp8.py for the formats)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixlm.srt.errors import ModelLoadError

if TYPE_CHECKING:  # reading a config's format needs no torch; the tensors below import it
    import torch


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "compressed-tensors" or "fp8"
    block: tuple[int, int] | None = None  # HF fp8: weight_block_size
    skip: frozenset[str] = frozenset()  # modules the checkpoint keeps unquantized (compressed-tensors `ignore`)


def fp8_format(raw_config: dict) -> Fp8Format | None:
    """The FP8 format of a checkpoint's `quantization_config`, None without one; another quantization method, or
    a compressed-tensors scheme that is not FP8 per channel or per tensor, is an error naming what it is."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ModelLoadError(
                f"quantization_config.weight_block_size must be two positive ints, got {block!r}", param="model_path"
            )
        return Fp8Format("fp8", tuple(block) if block else None)
    if method == "compressed-tensors":
        for name, group in (qc.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("channel", "tensor"):
                raise ModelLoadError(
                    f"compressed-tensors group {name!r} quantizes weights as {w.get('type')} {w.get('num_bits')}-bit "
                    f"per {w.get('strategy')}: only FP8 (float, 8 bits) per channel or per tensor is supported",
                    param="model_path",
                )
        return Fp8Format("compressed-tensors", skip=frozenset(qc.get("ignore") or ()))
    raise ModelLoadError(
        f"checkpoint quantization method {method!r} is not supported (FP8 checkpoints: "
        "compressed-tensors, or Hugging Face's fp8)",
        param="model_path",
    )


def _tensor_files(files) -> dict[str, object]:
    """name -> the file that holds it (a checkpoint's scales may sit in another shard than their weights)."""
    from safetensors import safe_open  # noqa: PLC0415

    where = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where[name] = file
    return where


def fp8_tensors(
    files, fmt: Fp8Format, part=None
) -> Iterator[tuple[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]:
    """Every tensor of the checkpoint: an e4m3 weight as (e4m3 [N, K], float32 per-channel scales [N]), every other
    one as stored; scales and static input scales are consumed (activations are scaled per token at run time).
    `part(name)`: this rank's (rows,) or (all rows, columns) of a tensor, or None for all of it (tensor
    parallelism); a per-channel weight's part is read alone, a block-scaled one is read whole and folded first
    (its blocks need not align with the ranks' ranges)."""
    from safetensors import safe_open  # noqa: PLC0415

    where = _tensor_files(files)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
                    continue
                want = part(name) if part is not None else None
                sl = f.get_slice(name)
                if sl.get_dtype() != "F8_E4M3":
                    yield name, (f.get_tensor(name) if want is None else sl[want])
                    continue
                if fmt.block or want is None:
                    q, scale = _paired(name, f.get_tensor(name), where, fmt)
                    yield name, (q, scale) if want is None else (q[want], scale[want[0]] if len(want) == 1 else scale)
                    continue
                rows = sl.get_shape()[0]
                scale = _scales(name, rows, where)
                yield name, (sl[want], scale[want[0]] if len(want) == 1 else scale)


def _paired(name: str, q: torch.Tensor, where: dict, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    from radixlm.srt.layers.quantization.fp8 import fold_block_scales

    if not fmt.block:
        return q, _scales(name, q.shape[0], where)
    scale = _stored_scale(name, ".weight_scale_inv", where)
    try:
        return fold_block_scales(q, scale, fmt.block)
    except ValueError as e:
        raise ModelLoadError(str(e), param="model_path") from e


def _scales(name: str, rows: int, where: dict) -> torch.Tensor:
    """The per-channel scales of per-channel (or per-tensor) e4m3 weight `name` with `rows` output channels."""
    from radixlm.srt.layers.quantization.fp8 import channel_scales

    scale = _stored_scale(name, ".weight_scale", where)
    try:
        return channel_scales(scale, rows, name[: -len(".weight")] + ".weight_scale")
    except ValueError as e:
        raise ModelLoadError(str(e), param="model_path") from e


def _stored_scale(name: str, suffix: str, where: dict) -> torch.Tensor:
    """The scale tensor stored beside e4m3 weight `name` (its `.weight` part replaced by `suffix`)."""
    from safetensors import safe_open  # noqa: PLC0415

    key = name[: -len(".weight")] + suffix
    if not name.endswith(".weight") or key not in where:
        raise ModelLoadError(f"FP8 tensor {name!r} has no {suffix[1:]} in the checkpoint", param="model_path")
    with safe_open(where[key], framework="pt") as f:
        return f.get_tensor(key)
