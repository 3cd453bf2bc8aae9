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
from radixlm.srt.utils import to_device


@dataclass
class TritonMetadata:
    num_splits: int = 1  # decode: KV splits per request (fixed per batch size, so graphs can capture it)
    max_extend_len: int = 0  # extend: sizes the grid
    # Extend batches with one-token rows (decodes riding along a prompt chunk): those rows go through the
    # decode kernel, whose program per (row, KV head, split) does not pay for a block of empty query rows.
    # Both subsets are selected once per forward, not once per layer.
    single: tuple[torch.Tensor, ...] | None = None  # (token indices, req_pool_indices, seq_lens)
    multi: tuple[torch.Tensor, ...] | None = None  # (req_pool_indices, prefix lens, extend lens, start locs)


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
            return
        lens = fb.extend_seq_lens_cpu or []
        single = [i for i, n in enumerate(lens) if n == 1]
        if not single:
            fb.attn_metadata = TritonMetadata(max_extend_len=fb.max_extend_len)
            return
        multi = [i for i, n in enumerate(lens) if n != 1]
        idx = to_device(torch.tensor(single + multi, dtype=torch.int64), fb.extend_seq_lens.device)
        one, rest = idx[:len(single)], idx[len(single):]
        fb.attn_metadata = TritonMetadata(
            num_splits=decode_num_splits(len(single), self.num_kv_heads, self.num_sms),
            max_extend_len=max((lens[i] for i in multi), default=1),
            single=tuple(t.index_select(0, one) for t in (fb.extend_start_loc, fb.req_pool_indices, fb.seq_lens)),
            multi=tuple(t.index_select(0, rest) for t in (fb.req_pool_indices, fb.extend_prefix_lens,
                                                          fb.extend_seq_lens, fb.extend_start_loc)) if multi else None)

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
        k_cache, v_cache = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        r2t = fb.req_to_token_pool.req_to_token
        md = fb.attn_metadata
        if md.single is None:
            out = extend_attention(q, k_cache, v_cache, r2t, fb.req_pool_indices, fb.extend_prefix_lens,
                                   fb.extend_seq_lens, fb.extend_start_loc, md.max_extend_len, layer.scaling)
            return out.view(q.shape[0], -1)
        out = torch.empty_like(q)
        tokens, rows, seq_lens = md.single  # the decode kernel reads and writes those rows in place
        decode_attention(q, k_cache, v_cache, r2t, rows, seq_lens, layer.scaling, md.num_splits, out=out,
                         q_rows=tokens)
        if md.multi is not None:
            extend_attention(q, k_cache, v_cache, r2t, *md.multi, md.max_extend_len, layer.scaling, out=out)
        return out.view(q.shape[0], -1)
