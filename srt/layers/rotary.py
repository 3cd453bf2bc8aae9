"""Rotary position embedding (rotate-half layout), with linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixlm.kernels.rope import apply_rotary_ref
from radixlm.srt.errors import ModelLoadError


def _inv_freq(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ModelLoadError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)", param="model_path"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        # One cache of [max_position, head_dim] = cos | sin halves, indexed by position.
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]."""
        cs = self.cos_sin.index_select(0, positions).unsqueeze(1)
        cos, sin = cs[..., : self.half], cs[..., self.half :]
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
