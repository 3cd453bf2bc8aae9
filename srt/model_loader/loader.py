"""Resolve a model path, pick device and dtype, build our model and fill it from the checkpoint."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.kernels import cpu as cpu_kernels
from radixlm.srt.choices import QUANTIZATION_METHODS
from radixlm.srt.distributed.parallel import SINGLE, TensorParallel
from radixlm.srt.errors import ModelLoadError
from radixlm.srt.layers.basic import deferred_linear_weights
from radixlm.srt.layers.quantization import fp8, fp8_load, load_gguf_quantized
from radixlm.srt.model_loader.gguf_loader import GGUFCheckpoint
from radixlm.srt.model_loader.hf_loader import HFCheckpoint, load_tokenizer
from radixlm.srt.model_loader.model_config import ModelConfig, parse_dtype
from radixlm.srt.model_loader.resolve import ResolvedModel, open_checkpoint, resolve_model  # noqa: F401 - re-exported
from radixlm.srt.models.llama import MODEL_REGISTRY

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixlm.srt.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    model_path: str
    served_model_name: str
    load_seconds: float
    quantization: str = "none"  # the method used (auto resolved)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available", param="device")
    return device


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32  # CPUs without bf16 units run fp32 matmuls much faster than bf16/fp16
    ckpt = parse_dtype(config.checkpoint_dtype) if config.checkpoint_dtype else None
    return ckpt if ckpt in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model(
    model_path: str | None = None,
    *,
    tokenizer_path: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    context_length: int | None = None,
    served_model_name: str | None = None,
    load_format: str = "auto",
    quantization: str = "auto",
    fp8_lm_head: bool = False,
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """`tp`: this process's rank of a tensor-parallel group; the model it builds holds only its shard."""
    start = time.perf_counter()
    ckpt, resolved, name = open_checkpoint(model_path, dummy=load_format == "dummy")
    config = ckpt.config
    if context_length is not None:
        if context_length <= 0:
            raise ValueError(f"context_length must be positive, got {context_length}")
        if context_length > config.context_length:
            logger.warning("context_length %d exceeds the model's %d", context_length, config.context_length)
        config = dataclasses.replace(config, context_length=context_length)
    dev = resolve_device(device)
    run_dtype = resolve_dtype(dtype, config, dev)
    requested = quantization
    quantization = resolve_quantization(quantization, ckpt, dev, load_format)
    if tp.size > 1 and requested == "auto" and quantization == "gguf":
        quantization = "none"  # a GGUF's blocks are not sharded: ranks dequantize their part
    if fp8_lm_head and quantization != "fp8":
        raise ModelLoadError(
            f"fp8_lm_head needs --quantization fp8 (this load resolved to {quantization})", param="fp8_lm_head"
        )
    fp8 = quantization == "fp8"
    if tp.size > 1 and quantization == "gguf":
        raise ModelLoadError(
            f"tp_size {tp.size} dequantizes a GGUF file's weights (each rank its part): use --quantization none",
            param="tp_size",
        )
    model_cls = MODEL_REGISTRY[config.architecture]
    old_default = torch.get_default_dtype()
    torch.set_default_dtype(run_dtype)
    try:
        # FP8: the projections get memory only in their e4m3 form, as they are filled (fp8_load.py)
        with torch.device(dev), deferred_linear_weights() if fp8 else contextlib.nullcontext():
            model = model_cls(config, tp=tp)
    finally:
        torch.set_default_dtype(old_default)
    if fp8:
        _load_fp8(model, ckpt, config, run_dtype, dev, load_format, fp8_lm_head, tp)
    elif load_format == "dummy":
        _random_weights(model)
    elif quantization == "gguf":
        load_gguf_quantized(model, ckpt, run_dtype)
    elif tp.size > 1:
        model.load_weights(ckpt.weights(run_dtype, part=model.rank_rows), sliced=True)  # each rank reads its part
    else:
        model.load_weights(ckpt.weights(run_dtype))
    model.eval()
    _trim_heap()
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else ckpt.load_tokenizer()
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config.eos_token_ids = [tokenizer.eos_token_id]
    seconds = time.perf_counter() - start
    logger.info(
        "loaded %s (%s, %s on %s, quantization %s) in %.1f s",
        name,
        config.architecture,
        run_dtype,
        dev,
        quantization,
        seconds,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        device=dev,
        dtype=run_dtype,
        model_path=resolved,
        served_model_name=served_model_name or name,
        load_seconds=seconds,
        quantization=quantization,
    )


def _load_fp8(
    model, ckpt, config, dtype: torch.dtype, device: torch.device, load_format: str, head: bool, tp: TensorParallel
) -> None:
    """Every rank quantizes (or reads) only its part: the per-channel scales of a column-parallel shard are its
    rows' scales, a row-parallel shard's are over its own columns (a checkpoint's are kept whole)."""
    skip = ckpt.fp8.skip if isinstance(ckpt, HFCheckpoint) and ckpt.fp8 is not None else frozenset()
    quantized = fp8_load.fp8_linears(model, head=head and not config.tie_word_embeddings, skip=skip)
    fp8_load.materialize_others(model, quantized, dtype, device)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(0)
        fp8_load.random_fp8(model, quantized, dtype, device, gen)
        _random_weights(model)
    else:
        part = model.rank_rows if tp.size > 1 else None
        fp8_load.load_fp8(model, ckpt.tensors(part), quantized, dtype, device, sliced=part is not None)
    if head and config.tie_word_embeddings:
        fp8_load.fp8_tied_head(model)
    logger.info(fp8_load.summary(model))


def _trim_heap() -> None:
    """glibc keeps the freed temporaries of loading (dequantized arrays, packing buffers) in its heap; hand them
    back, so that the process's resident memory is what the model holds (~140 MB for the quantized SmolLM2)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def resolve_quantization(quantization: str, ckpt, device: torch.device, load_format: str) -> str:
    """The method the load uses. auto keeps a GGUF file's Q4 linears packed where one of our Q4 kernels runs them
    (AVX-512 BF16, or AVX2 with FMA and F16C: several times the fp32 path's decode speed, an eighth of its
    memory); elsewhere it dequantizes. gguf asks for the packed weights anywhere on a CPU: torch's int4 op runs
    them where our kernels do not (no faster than fp32 there)."""
    is_gguf = isinstance(ckpt, GGUFCheckpoint) and load_format != "dummy"
    fp8_ckpt = isinstance(ckpt, HFCheckpoint) and ckpt.fp8 is not None and load_format != "dummy"
    if quantization == "fp8":
        why = fp8.fp8_supported(device)
        if why is not None:
            raise ModelLoadError(why, param="quantization")
        if is_gguf:
            raise ModelLoadError(
                "quantization=fp8 reads a Hugging Face checkpoint (bf16 or FP8) or random weights, not a GGUF file",
                param="quantization",
            )
        return "fp8"
    if quantization == "auto" and fp8_ckpt:
        if fp8.fp8_supported(device) is None:
            return "fp8"
        logger.info("FP8 checkpoint on %s: its weights are dequantized to the run dtype", device)
        return "none"
    if quantization == "auto":
        fast = device.type == "cpu" and is_gguf and ckpt.has_q4_weights() and cpu_kernels.q4_available()
        return "gguf" if fast else "none"
    if quantization == "none":
        return quantization
    if quantization != "gguf":
        raise ModelLoadError(
            f"unknown quantization {quantization!r}; choices: {', '.join(QUANTIZATION_METHODS)}", param="quantization"
        )
    if not is_gguf:
        raise ModelLoadError(
            "quantization=gguf keeps a GGUF file's quantized weights: it needs a .gguf "
            f"checkpoint, but {ckpt.path} is not one",
            param="quantization",
        )
    if device.type != "cpu":
        raise ModelLoadError(
            f"quantization=gguf runs through torch's int4 CPU matmul and supports only the cpu "
            f"device so far, not {device}",
            param="quantization",
        )
    return quantization


@torch.no_grad()
def _random_weights(model: torch.nn.Module) -> None:
    """Speed does not depend on weight values: fill in place on the device (norm weights 1, the rest small)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
