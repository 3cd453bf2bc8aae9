"""The small per-layer ops a forward is made of, as one swappable set: torch references (CPU, and the
fallback), our Triton kernels (CUDA), or FlashInfer's where they measure faster. The model runner picks the
set once and hands it to the model (`set_kernel_ops`); layers never branch on the device."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixlm.kernels.activation import silu_and_mul_ref
from radixlm.kernels.norm import fused_add_rmsnorm_ref, rmsnorm_ref
from radixlm.kernels.rope import rope_and_store_ref


@dataclass(frozen=True)
class KernelOps:
    name: str
    rmsnorm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (rmsnorm(x + residual), x + residual); may reuse x and residual's memory.
    fused_add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (positions, q, k, v, cos_sin, k_cache, v_cache, loc, q_norm_w, k_norm_w, eps) -> rotated q; stores k, v.
    rope_and_store: Callable[..., torch.Tensor]


TORCH_OPS = KernelOps("torch", rmsnorm_ref, fused_add_rmsnorm_ref, silu_and_mul_ref, rope_and_store_ref)


def triton_ops() -> KernelOps:
    from radixlm.kernels.activation import silu_and_mul
    from radixlm.kernels.norm import fused_add_rmsnorm_, rmsnorm
    from radixlm.kernels.rope import rope_and_store

    return KernelOps("triton", rmsnorm, fused_add_rmsnorm_, silu_and_mul, rope_and_store)


def flashinfer_ops() -> KernelOps:
    """FlashInfer's norm and activation kernels with our fused rope + KV store (FlashInfer's rope does not
    write the cache, so ours saves a pass over K and V)."""
    import flashinfer

    from radixlm.kernels.rope import rope_and_store

    def fused_add(x, residual, weight, eps):
        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    return KernelOps("flashinfer", lambda x, w, eps: flashinfer.norm.rmsnorm(x, w, eps), fused_add,
                     flashinfer.activation.silu_and_mul, rope_and_store)


def select_kernel_ops(name: str, device: torch.device) -> KernelOps:
    """`auto`: Triton on CUDA when installed, else the torch references."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if name == "flashinfer":
        return flashinfer_ops()
    try:
        return triton_ops()
    except ImportError:
        if name == "triton":
            raise
        return TORCH_OPS
