"""Attention through our Triton kernels (kernels/): split-KV decode and ragged paged extend.

Needs no compilation step beyond Triton's JIT; every launch reads only tensors, so CUDA graphs capture decode
batches and, through a fixed-size layout of their metadata (`ExtendLayout`), extend and mixed batches too.
On CPU the same kernels run in Triton's interpreter (tests only: it is slow).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from radixlm.kernels.decode_attention import decode_attention
from radixlm.kernels.decode_attention_rows import decode_attention_rows, rows_items_cap
from radixlm.kernels.decode_launch import decode_num_splits
from radixlm.kernels.extend_attention import extend_attention, extend_block_m, extend_blocks
from radixlm.srt.layers.attention.base import AttentionBackend
from radixlm.srt.model_executor.forward_batch import ForwardBatch
from radixlm.srt.utils import to_device


@dataclass
class TritonMetadata:
    num_splits: int = 1  # decode: KV splits per request (fixed per batch size, so graphs can capture it)
    # Extend batches. One-token rows (decodes riding along a prompt chunk) go through the decode kernel, whose
    # work item per (row, KV head, split) does not pay for a block of empty query rows; the others through the
    # extend kernel's block table. See ExtendLayout.
    single: tuple[torch.Tensor, ...] | None = None  # (q rows, req_pool_indices, seq_lens, ctl [count, splits])
    single_items: int = 0  # (row, split) items the decode kernel buffers for
    multi: tuple[torch.Tensor, ...] | None = None  # (req_pool_indices, prefix lens, extend lens, starts, blocks)
    padded: bool = False  # a graph's layout: rows past the batch get zeros, not whatever memory held


def _even(n: int) -> int:
    """Sections of an even number of int64 entries keep every view 16-byte aligned: Triton compiles a kernel
    per argument alignment, and a batch whose views fell otherwise would compile one mid-serving."""
    return n + (n & 1)


@dataclass(frozen=True)
class ExtendLayout:
    """An extend batch's attention metadata as one int64 array, for room for `singles` one-token rows,
    `multis` longer requests and `blocks` extend-kernel blocks: [single q rows, single req rows, single seq
    lens] x singles, ctl (count, splits), [multi req rows, prefix lens, extend lens, starts] x multis, [block
    request (-1: unused), block index] x blocks. The exact layout of a batch is what an eager forward copies
    over; a CUDA graph keeps a larger one per token bucket and replays with any batch that fits."""

    singles: int
    multis: int
    blocks: int

    @property
    def size(self) -> int:
        return self.blocks_at + 2 * self.blocks

    @property
    def ctl_at(self) -> int:
        return 3 * self.singles

    @property
    def multis_at(self) -> int:
        return self.ctl_at + 2

    @property
    def blocks_at(self) -> int:
        return self.multis_at + 4 * self.multis


class TritonAttnBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    supports_extend_graph = True

    def __init__(self, num_kv_heads: int, device: torch.device, head_dim: int, kv_dtype: torch.dtype | None = None):
        self.num_kv_heads = num_kv_heads
        self.kv_dtype = kv_dtype  # the pool's: an e4m3 pool splits the KV differently (decode_num_splits)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        self.block_m = extend_block_m(head_dim, device.type == "cuda")
        # The CUDA graph runner sets this to the captured size a batch pads to, so an eager decode splits the KV
        # exactly as the graph would and both give bit-identical results.
        self.graph_bucket = None

    def _splits(self, bs: int) -> int:
        if self.graph_bucket is not None:
            bs = self.graph_bucket(bs)
        return decode_num_splits(bs, self.num_kv_heads, self.num_sms, self.kv_dtype)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode.is_decode:
            fb.attn_metadata = TritonMetadata(num_splits=self._splits(fb.batch_size))
            return
        lens = fb.extend_seq_lens_cpu
        singles = sum(1 for n in lens if n == 1)
        layout = ExtendLayout(
            _even(singles), _even(len(lens) - singles), _even(sum(-(-n // self.block_m) for n in lens if n != 1))
        )
        host = torch.empty(layout.size, dtype=torch.int64)
        self.fill_extend(
            host.numpy(), layout, fb.extend_prefix_lens_cpu, lens, fb.req_pool_indices_cpu, fb.seq_lens_cpu
        )
        fb.attn_metadata = self.extend_metadata(to_device(host, fb.extend_seq_lens.device), layout, rows=singles)

    # --- extend metadata in a fixed layout (eager batches and extend CUDA graphs) ----------------------------
    def extend_graph_layout(self, tokens: int, max_rows: int) -> ExtendLayout:
        """Room for any batch of up to `tokens` tokens with at most `max_rows` requests, of which at most 256
        have one token and at most min(tokens // 2, 32) more than one (other batches run eagerly: many prompts
        in one batch make a step long enough to hide the launches). The kernels' grids are sized for that room,
        the programs past a batch's work returning at once, and those are not free: the extend kernel of a
        288-token mixed step took 1.6x as long with room for 128 prompts as with room for 33 (its programs hold
        enough shared memory that few fit on an SM, returning or not)."""
        multis = _even(max(1, min(tokens // 2, 32, max_rows)))
        return ExtendLayout(_even(min(tokens, max_rows, 256)), multis, _even(-(-tokens // self.block_m) + multis))

    def fits_extend(self, layout: ExtendLayout, extend_lens: list[int]) -> bool:
        singles = sum(1 for n in extend_lens if n == 1)
        return singles <= layout.singles and len(extend_lens) - singles <= layout.multis

    def fill_extend(self, arr: np.ndarray, layout: ExtendLayout, prefix_lens, extend_lens, rows, seq_lens) -> None:
        """Write a batch (that fits) into `arr` in `layout`; unused room is zeros, unused blocks request -1."""
        s, r, nb = layout.singles, layout.multis, layout.blocks
        arr[:] = 0
        one = [i for i, n in enumerate(extend_lens) if n == 1]
        multi = [i for i, n in enumerate(extend_lens) if n != 1]
        starts = list(itertools.accumulate(extend_lens, initial=0))
        for sec, values in enumerate((starts, rows, seq_lens)):
            arr[sec * s : sec * s + len(one)] = [values[i] for i in one]
        c = layout.ctl_at
        arr[c : c + 2] = len(one), decode_num_splits(len(one), self.num_kv_heads, self.num_sms, self.kv_dtype)
        m = layout.multis_at
        for sec, values in enumerate((rows, prefix_lens, extend_lens, starts)):
            arr[m + sec * r : m + sec * r + len(multi)] = [values[i] for i in multi]
        reqs, blocks = extend_blocks([extend_lens[i] for i in multi], self.block_m)
        b = layout.blocks_at
        arr[b : b + nb] = -1
        arr[b : b + len(reqs)] = reqs
        arr[b + nb : b + nb + len(blocks)] = blocks

    def extend_metadata(self, dev: torch.Tensor, layout: ExtendLayout, rows: int | None = None) -> TritonMetadata:
        """Metadata viewing `dev`, a device copy of an array `fill_extend` wrote in `layout`. `rows`: the layout
        is this batch's own, with that many one-token rows (no room to spare beyond the even rounding), so
        parts it has none of are skipped and the decode kernel's launch is sized to the batch; None: a graph's
        layout, whose launches are sized for any batch that fits."""
        s, r, nb = layout.singles, layout.multis, layout.blocks
        exact = rows is not None
        md = TritonMetadata(padded=not exact)
        if s or not exact:
            c = layout.ctl_at
            md.single = (dev[0:s], dev[s : 2 * s], dev[2 * s : c], dev[c : c + 2])
            md.single_items = (
                rows * decode_num_splits(rows, self.num_kv_heads, self.num_sms, self.kv_dtype)
                if exact
                else rows_items_cap(s, self.num_kv_heads, self.num_sms, self.kv_dtype)
            )
        if r or not exact:
            m, b = layout.multis_at, layout.blocks_at
            md.multi = (*(dev[m + sec * r : m + (sec + 1) * r] for sec in range(4)), dev[b : b + 2 * nb].view(2, nb))
        return md

    def init_forward_metadata_capture(self, bs: int, fb: ForwardBatch) -> None:
        fb.attn_metadata = TritonMetadata(num_splits=self._splits(bs))

    def init_forward_metadata_replay(self, bs: int, fb: ForwardBatch) -> None:
        pass  # everything the kernels read lives in the graph's static buffers

    def forward_decode(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        out = decode_attention(
            q,
            pool.k_buffer[layer.layer_id],
            pool.v_buffer[layer.layer_id],
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.scaling,
            fb.attn_metadata.num_splits,
            **pool.scales(layer.layer_id),
        )
        return out.view(q.shape[0], -1)

    def forward_extend(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        k_cache, v_cache = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        r2t = fb.req_to_token_pool.req_to_token
        md = fb.attn_metadata
        out = torch.zeros_like(q) if md.padded else torch.empty_like(q)
        scales = pool.scales(layer.layer_id)
        if md.single is not None:  # the decode kernel reads and writes those rows in place
            decode_attention_rows(q, k_cache, v_cache, r2t, *md.single, layer.scaling, out, md.single_items, **scales)
        if md.multi is not None:
            extend_attention(q, k_cache, v_cache, r2t, *md.multi, layer.scaling, out=out, **scales)
        return out.view(q.shape[0], -1)
