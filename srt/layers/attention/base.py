"""The attention backend interface: plan once per batch, then run per layer.

Contract: by the time a layer's attention runs, the batch's new K/V are already in the pool at
`out_cache_loc` (the rope kernel stored them), so a backend only reads the pool.
"""

from __future__ import annotations

import torch

from radixlm.srt.model_executor.forward_batch import ForwardBatch


class AttentionBackend:
    name = "base"
    # Whether the decode forward reads only tensors, so that CUDA graphs can capture it.
    supports_cuda_graph = False
    # True where init_forward_metadata_replay reads the graph's input buffers on the device: the decode graph then
    # fills them before that metadata, not as its own first kernel.
    replay_reads_inputs = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Once per batch, before the first layer (where FlashInfer's `plan` goes)."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, layer: "RadixAttention", fb: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D] (rotated); returns [T, H * D]."""
        if fb.mode.is_decode:
            return self.forward_decode(q, layer, fb)
        return self.forward_extend(q, layer, fb)

    def forward_extend(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    # --- CUDA graphs (backends with supports_cuda_graph) ---------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate the fixed buffers every captured batch size shares."""

    def init_forward_metadata_capture(self, bs: int, fb: ForwardBatch) -> None:
        """Metadata for capturing the decode graph of batch size `bs`; `fb` holds the static buffers."""
        raise NotImplementedError

    def init_forward_metadata_replay(self, bs: int, fb: ForwardBatch) -> None:
        """Refresh the captured metadata for this replay (outside the graph); `fb.seq_lens_cpu` is padded."""
        raise NotImplementedError

    def warmup(self) -> None:
        """Compile whatever compiles lazily, so the first request does not pay for it."""


class RadixAttention(torch.nn.Module):
    """The attention op a model layer calls; which kernels run is the batch's backend's business."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, self, fb)
