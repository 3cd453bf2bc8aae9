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
    single_rows: torch.Tensor | None = None  # their request indices in the batch
    single_tokens: torch.Tensor | None = None  # and their token indices
    multi_rows: torch.Tensor | None = None  # the rows left for the extend kernel (None: every row)


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
        starts, acc = [], 0
        for n in lens:
            starts.append(acc)
            acc += n
        multi = [i for i, n in enumerate(lens) if n != 1]
        dev = fb.extend_seq_lens.device
        idx = to_device(torch.tensor(single + [starts[i] for i in single] + multi, dtype=torch.int64), dev)
        k = len(single)
        fb.attn_metadata = TritonMetadata(
            num_splits=decode_num_splits(k, self.num_kv_heads, self.num_sms),
            max_extend_len=max((lens[i] for i in multi), default=1),
            single_rows=idx[:k], single_tokens=idx[k:2 * k], multi_rows=idx[2 * k:] if multi else idx[:0])

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
        if md.single_rows is None:
            out = extend_attention(q, k_cache, v_cache, r2t, fb.req_pool_indices, fb.extend_prefix_lens,
                                   fb.extend_seq_lens, fb.extend_start_loc, md.max_extend_len, layer.scaling)
            return out.view(q.shape[0], -1)
        out = torch.empty_like(q)
        one = decode_attention(q.index_select(0, md.single_tokens), k_cache, v_cache, r2t,
                               fb.req_pool_indices.index_select(0, md.single_rows),
                               fb.seq_lens.index_select(0, md.single_rows), layer.scaling, md.num_splits)
        out.index_copy_(0, md.single_tokens, one)
        if md.multi_rows.numel():
            rows = md.multi_rows
            extend_attention(q, k_cache, v_cache, r2t, fb.req_pool_indices.index_select(0, rows),
                             fb.extend_prefix_lens.index_select(0, rows), fb.extend_seq_lens.index_select(0, rows),
                             fb.extend_start_loc.index_select(0, rows), md.max_extend_len, layer.scaling, out=out)
        return out.view(q.shape[0], -1)
