"""Attention backends by name. The registry is the single source of `--attention-backend` choices."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from radixlm.srt.choices import ATTENTION_BACKENDS as BACKENDS

if TYPE_CHECKING:
    from radixlm.srt.layers.attention.base import AttentionBackend


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Head sizes FlashInfer's prefill/decode kernels are built for; others fail inside the kernel dispatch.
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def _check_flashinfer(device_type: str, fi_dtype: bool, fi_heads: bool, head_dim, dtype) -> None:
    # Device and model checks first: they hold whether or not the package is installed here.
    needs = "attention_backend flashinfer needs a CUDA device and the flashinfer package (pip install 'radixlm[gpu]')"
    if device_type != "cuda":
        raise ValueError(needs)
    if not fi_dtype:
        raise ValueError(
            f"attention_backend flashinfer runs float16 and bfloat16, not {dtype}: use --dtype bfloat16 "
            "or --attention-backend triton"
        )
    if not fi_heads:
        raise ValueError(
            f"attention_backend flashinfer has kernels for head sizes {FLASHINFER_HEAD_DIMS}; this "
            f"model's is {head_dim}: use --attention-backend triton"
        )
    if not _importable("flashinfer"):
        raise ValueError(needs)


def resolve_backend(
    name: str, device_type: str, head_dim: int | None = None, dtype=None, kv_cache_dtype: str = "auto"
) -> str:
    """`auto`: FlashInfer when importable on CUDA (and it has kernels for the model's head size and dtype, and the
    KV cache is not e4m3, which its wrappers are not given here), else Triton on CUDA, else torch-native."""
    fi_heads = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
    fi_dtype = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        fi_kv = kv_cache_dtype != "fp8_e4m3"
        if device_type == "cuda" and fi_heads and fi_dtype and fi_kv and _importable("flashinfer"):
            return "flashinfer"
        if device_type == "cuda" and _importable("triton"):
            return "triton"
        return "torch_native"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {('auto', *BACKENDS)}, got {name!r}")
    if name == "flashinfer":
        _check_flashinfer(device_type, fi_dtype, fi_heads, head_dim, dtype)
    if name == "triton" and not _importable("triton"):
        raise ValueError("attention_backend triton needs the triton package")
    return name


def create_backend(name: str, runner) -> "AttentionBackend":
    cfg = runner.config
    if name == "torch_native":
        from radixlm.srt.layers.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend(runner.device)
    if name == "triton":
        from radixlm.srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(
            cfg.num_kv_heads, runner.device, cfg.head_dim, runner.kv_dtype, group=cfg.num_heads // cfg.num_kv_heads
        )
    from radixlm.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        runner.dtype,
        runner.dtype,
        runner.req_to_token_pool.req_to_token,
        runner.max_total_tokens,
        runner.max_running_requests,
        runner.device,
        prefill_backend=getattr(runner.server_args, "flashinfer_prefill_backend", "fa2"),
    )
