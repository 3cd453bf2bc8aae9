"""Attention through our Triton kernels (kernels/): split-KV decode, ragged paged extend, and the short extends
of a speculative verify step.

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
from radixlm.kernels.short_extend_attention import short_caps, short_extend_attention, short_max_tokens, short_splits
from radixlm.srt.layers.attention.base import AttentionBackend
from radixlm.srt.model_executor.forward_batch import ForwardBatch
from radixlm.srt.utils import to_device


@dataclass
class TritonMetadata:
    num_splits: int = 1  # decode: KV splits per request (fixed per batch size, so graphs can capture it)
    # Extend batches. One-token rows (decodes riding along a prompt chunk) go through the decode kernel, whose
    # work item per (row, KV head, split) does not pay for a block of empty query rows; requests of a few tokens
    # (a verify step's drafts) through the short-extend kernel, whose item per (request, KV head, split) holds
    # all their rows; the others through the extend kernel's block table. See ExtendLayout.
    single: tuple[torch.Tensor, ...] | None = None  # (q rows, req_pool_indices, seq_lens, ctl [count, splits])
    single_items: int = 0  # (row, split) items the decode kernel buffers for
    short: tuple[torch.Tensor, ...] | None = None  # (req_pool_indices, prefix lens, extend lens, starts, ctl)
    short_caps: tuple[int, int, int] = (0, 0, 0)  # the short-extend launch's room (kernels' `short_caps`)
    multi: tuple[torch.Tensor, ...] | None = None  # (req_pool_indices, prefix lens, extend lens, starts, blocks)
    padded: bool = False  # a graph's layout: rows past the batch get zeros, not whatever memory held


def _even(n: int) -> int:
    """Sections of an even number of int64 entries keep every view 16-byte aligned: Triton compiles a kernel
    per argument alignment, and a batch whose views fell otherwise would compile one mid-serving."""
    return n + (n & 1)


@dataclass(frozen=True)
class ExtendLayout:
    """An extend batch's attention metadata as one int64 array, for room for `singles` one-token rows,
    `multis` longer requests, `blocks` extend-kernel blocks and `shorts` requests of a few tokens: [single q
    rows, single req rows, single seq lens] x singles, ctl (count, splits), [multi req rows, prefix lens, extend
    lens, starts] x multis, [short req rows, prefix lens, extend lens, starts] x shorts, short ctl (count,
    splits), [block request (-1: unused), block index] x blocks. The exact layout of a batch is what an eager
    forward copies over; a CUDA graph keeps a larger one per token bucket and replays with any batch that fits."""

    singles: int
    multis: int
    blocks: int
    shorts: int = 0

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
    def shorts_at(self) -> int:
        return self.multis_at + 4 * self.multis

    @property
    def blocks_at(self) -> int:
        return self.shorts_at + 4 * self.shorts + 2


def _request_sections(dev: torch.Tensor, at: int, room: int) -> list[torch.Tensor]:
    """The four per-request sections of a layout (req rows, prefix lens, extend lens, starts) from `at`."""
    return [dev[at + sec * room : at + (sec + 1) * room] for sec in range(4)]


class TritonAttnBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    supports_extend_graph = True

    def __init__(
        self,
        num_kv_heads: int,
        device: torch.device,
        head_dim: int,
        kv_dtype: torch.dtype | None = None,
        group: int = 1,
    ):
        self.num_kv_heads = num_kv_heads
        # requests of 2..short_max new tokens take the short-extend kernel (0: none; `group` query heads per KV head)
        self.short_max = short_max_tokens(group)
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
        kinds = [self._kind(n) for n in lens]
        singles, shorts = kinds.count(0), kinds.count(1)
        blocks = sum(-(-n // self.block_m) for n, k in zip(lens, kinds) if k == 2)
        layout = ExtendLayout(_even(singles), _even(kinds.count(2)), _even(blocks), _even(shorts))
        host = torch.empty(layout.size, dtype=torch.int64)
        self.fill_extend(
            host.numpy(), layout, fb.extend_prefix_lens_cpu, lens, fb.req_pool_indices_cpu, fb.seq_lens_cpu
        )
        dev = to_device(host, fb.extend_seq_lens.device)
        fb.attn_metadata = self.extend_metadata(dev, layout, counts=(singles, shorts))

    def _kind(self, n: int) -> int:
        """Which kernel a request of n new tokens takes: 0 the decode rows', 1 the short extend's, 2 the extend's."""
        return 0 if n == 1 else 1 if n <= self.short_max else 2

    # --- extend metadata in a fixed layout (eager batches and extend CUDA graphs) ----------------------------
    def extend_graph_layout(self, tokens: int, max_rows: int) -> ExtendLayout:
        """Room for any batch of up to `tokens` tokens with at most `max_rows` requests, of which at most 256
        have one token and at most min(tokens // 2, 32) more than one (other batches run eagerly: many prompts
        in one batch make a step long enough to hide the launches). The kernels' grids are sized for that room,
        the programs past a batch's work returning at once, and those are not free: the extend kernel of a
        288-token mixed step took 1.6x as long with room for 128 prompts as with room for 33 (its programs hold
        enough shared memory that few fit on an SM, returning or not)."""
        multis = _even(max(1, min(tokens // 2, 32, max_rows)))
        shorts = _even(min(tokens // 2, max_rows, 256)) if self.short_max else 0
        return ExtendLayout(
            _even(min(tokens, max_rows, 256)), multis, _even(-(-tokens // self.block_m) + multis), shorts
        )

    def fits_extend(self, layout: ExtendLayout, extend_lens: list[int]) -> bool:
        kinds = [self._kind(n) for n in extend_lens]
        return kinds.count(0) <= layout.singles and kinds.count(1) <= layout.shorts and kinds.count(2) <= layout.multis

    def fill_extend(self, arr: np.ndarray, layout: ExtendLayout, prefix_lens, extend_lens, rows, seq_lens) -> None:
        """Write a batch (that fits) into `arr` in `layout`; unused room is zeros, unused blocks request -1."""
        s, r, nb = layout.singles, layout.multis, layout.blocks
        arr[:] = 0
        kinds = [self._kind(n) for n in extend_lens]
        one = [i for i, k in enumerate(kinds) if k == 0]
        short = [i for i, k in enumerate(kinds) if k == 1]
        multi = [i for i, k in enumerate(kinds) if k == 2]
        starts = list(itertools.accumulate(extend_lens, initial=0))
        for sec, values in enumerate((starts, rows, seq_lens)):
            arr[sec * s : sec * s + len(one)] = [values[i] for i in one]
        c = layout.ctl_at
        arr[c : c + 2] = len(one), decode_num_splits(len(one), self.num_kv_heads, self.num_sms, self.kv_dtype)
        for at, room, picked in ((layout.multis_at, r, multi), (layout.shorts_at, layout.shorts, short)):
            for sec, values in enumerate((rows, prefix_lens, extend_lens, starts)):
                arr[at + sec * room : at + sec * room + len(picked)] = [values[i] for i in picked]
        t, sh = layout.shorts_at, layout.shorts
        arr[t + 4 * sh : t + 4 * sh + 2] = (
            len(short),
            short_splits(len(short), self.num_kv_heads, self.num_sms, self.kv_dtype),
        )
        reqs, blocks = extend_blocks([extend_lens[i] for i in multi], self.block_m)
        b = layout.blocks_at
        arr[b : b + nb] = -1
        arr[b : b + len(reqs)] = reqs
        arr[b + nb : b + nb + len(blocks)] = blocks

    def extend_metadata(
        self, dev: torch.Tensor, layout: ExtendLayout, counts: tuple[int, int] | None = None
    ) -> TritonMetadata:
        """Metadata viewing `dev`, a device copy of an array `fill_extend` wrote in `layout`. `counts`: the
        layout is this batch's own, with that many one-token rows and short requests (no room to spare beyond
        the even rounding), so parts it has none of are skipped and the decode and short kernels' launches are
        sized to the batch; None: a graph's layout, whose launches are sized for any batch that fits."""
        s, r, nb = layout.singles, layout.multis, layout.blocks
        exact = counts is not None
        rows, shorts = counts if exact else (None, None)
        md = TritonMetadata(padded=not exact)
        if s or not exact:
            c = layout.ctl_at
            md.single = (dev[0:s], dev[s : 2 * s], dev[2 * s : c], dev[c : c + 2])
            md.single_items = (
                rows * decode_num_splits(rows, self.num_kv_heads, self.num_sms, self.kv_dtype)
                if exact
                else rows_items_cap(s, self.num_kv_heads, self.num_sms, self.kv_dtype)
            )
        sh = layout.shorts
        if exact and shorts or not exact and sh:
            t = layout.shorts_at
            md.short = (*_request_sections(dev, t, sh), dev[t + 4 * sh : t + 4 * sh + 2])
            # a batch's own layout: exactly its count (no partials buffered where it is not split); a graph's:
            # any count up to its room
            most, least = (shorts, shorts) if exact else (sh, 1)
            md.short_caps = short_caps(most, self.num_kv_heads, self.num_sms, self.kv_dtype, least)
        if r or not exact:
            b = layout.blocks_at
            md.multi = (*_request_sections(dev, layout.multis_at, r), dev[b : b + 2 * nb].view(2, nb))
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
        if md.short is not None:
            short_extend_attention(q, k_cache, v_cache, r2t, *md.short, layer.scaling, out, md.short_caps, **scales)
        if md.multi is not None:
            extend_attention(q, k_cache, v_cache, r2t, *md.multi, layer.scaling, out=out, **scales)
        return out.view(q.shape[0], -1)
