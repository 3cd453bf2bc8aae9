"""The attention backend interface: plan once per batch, then run per layer."""
from __future__ import annotations

import torch

from radixlm.srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend:
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Once per batch, before the first layer (where FlashInfer's `plan` goes)."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D]; writes k/v to the pool at `out_cache_loc`; returns [T, H * D]."""
        if fb.mode.is_decode:
            return self.forward_decode(q, k, v, layer, fb)
        return self.forward_extend(q, k, v, layer, fb)

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError


class RadixAttention(torch.nn.Module):
    """The attention op a model layer calls; which kernels run is the batch's backend's business."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, k, v, self, fb)
