"""Attention through our Triton kernels (kernels/): split-KV decode and ragged paged extend.

Needs no compilation step beyond Triton's JIT; the decode path reads only tensors, so CUDA graphs capture it.
On CPU the same kernels run in Triton's interpreter (tests only: it is slow).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.decode_attention import decode_attention, decode_num_splits
from radixlm.kernels.extend_attention import extend_attention
from radixlm.srt.layers.attention.base import AttentionBackend
from radixlm.srt.model_executor.forward_batch import ForwardBatch


@dataclass
class TritonMetadata:
    num_splits: int = 1  # decode: KV splits per request (fixed per batch size, so graphs can capture it)
    max_extend_len: int = 0  # extend: sizes the grid


class TritonAttnBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(self, num_kv_heads: int, device: torch.device):
        self.num_kv_heads = num_kv_heads
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # The CUDA graph runner sets this to the captured size a batch pads to, so an eager decode splits the KV
        # exactly as the graph would and both give bit-identical results.
        self.graph_bucket = None

    def _splits(self, bs: int) -> int:
        if self.graph_bucket is not None:
            bs = self.graph_bucket(bs)
        return decode_num_splits(bs, self.num_kv_heads, self.num_sms)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode.is_decode:
            fb.attn_metadata = TritonMetadata(num_splits=self._splits(fb.batch_size))
        else:
            fb.attn_metadata = TritonMetadata(max_extend_len=fb.max_extend_len)

    def init_forward_metadata_capture(self, bs: int, fb: ForwardBatch) -> None:
        fb.attn_metadata = TritonMetadata(num_splits=self._splits(bs))

    def init_forward_metadata_replay(self, bs: int, fb: ForwardBatch) -> None:
        pass  # everything the kernels read lives in the graph's static buffers

    def forward_decode(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        out = decode_attention(q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id],
                               fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                               layer.scaling, fb.attn_metadata.num_splits)
        return out.view(q.shape[0], -1)

    def forward_extend(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        out = extend_attention(q, pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id],
                               fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens,
                               fb.extend_seq_lens, fb.extend_start_loc, fb.attn_metadata.max_extend_len,
                               layer.scaling)
        return out.view(q.shape[0], -1)
