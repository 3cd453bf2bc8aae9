"""Attention with torch's scaled_dot_product_attention over K/V gathered from the paged pool.

Works on CPU and CUDA. Requests are padded to the batch's longest query/KV length so that one SDPA
call serves the whole batch (no Python loop over requests); masks carry causality and raggedness.
On CPU with an fp32 pool, decode runs our C kernel instead (kernels/cpu.py): it reads each request's own
slots straight from the pool, with no gather copy and no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels import cpu as cpu_kernels
from radixlm.kernels.rope import gather_rows
from radixlm.srt.layers.attention.base import AttentionBackend
from radixlm.srt.model_executor.forward_batch import ForwardBatch

_SCORE_BUDGET = 1 << 30  # bytes of attention scores one SDPA call may materialize


@dataclass
class TorchNativeMetadata:
    kv_idx: torch.Tensor  # [B, max_kv] KV slot of every (request, position); padding points at slot 0
    mask: torch.Tensor  # [B, 1, q, max_kv]
    q_idx: torch.Tensor | None = None  # extend: [B, max_q] row of each padded query in the batch
    out_idx: torch.Tensor | None = None  # extend: padded output rows that are real


_ROWS_AS_DECODE = 16  # an extend whose requests add at most this many tokens each runs them as decode rows


@dataclass
class CpuDecodeMetadata:
    """Decode through our C kernel: it reads each request's own slots from req_to_token, no gather, no padding.
    For a short extend (a speculative verify, decodes riding along a small prompt chunk) every query row is
    one such decode row: row j of a request attends to its first prefix + j + 1 slots (`rows`, `seq_lens`)."""

    max_len: int
    rows: torch.Tensor | None = None  # extend: the request-table row of every query row
    seq_lens: torch.Tensor | None = None  # extend: how many slots every query row attends to


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, device: torch.device | None = None):
        if device is not None and device.type == "cuda":
            # cuDNN's SDPA builds and caches a graph for every new KV length; decode changes that length every
            # step, which made a step 2-3x slower until each length had been seen once.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # On CPU, decode attention in C (kernels/cpu.py): the gathers + SDPA were ~35 us a layer at batch 1.
        self.cpu_decode = device is not None and device.type == "cpu" and cpu_kernels.load() is not None

    def _c_decode(self, fb: ForwardBatch) -> bool:
        pool = fb.token_to_kv_pool
        if not (self.cpu_decode and pool.dtype == torch.float32 and pool.k_buffer.shape[-1] % 16 == 0):
            return False
        return fb.mode.is_decode or max(fb.extend_seq_lens_cpu) <= _ROWS_AS_DECODE

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if self._c_decode(fb):
            meta = CpuDecodeMetadata(max(fb.seq_lens_cpu))
            if not fb.mode.is_decode:
                rows, lens = [], []
                for row, prefix, n in zip(fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
                    rows += [row] * n
                    lens += range(prefix + 1, prefix + n + 1)
                meta.rows = torch.tensor(rows, dtype=torch.int64)
                meta.seq_lens = torch.tensor(lens, dtype=torch.int64)
            fb.attn_metadata = meta
            return
        device = fb.seq_lens.device
        max_kv = max(fb.seq_lens_cpu)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_kv].long()
        ar_kv = torch.arange(max_kv, device=device)
        kv_valid = ar_kv[None, :] < fb.seq_lens[:, None]  # [B, max_kv]
        kv_idx = torch.where(kv_valid, rows, 0)
        if fb.mode.is_decode:
            fb.attn_metadata = TorchNativeMetadata(kv_idx, kv_valid[:, None, None, :])
        else:
            max_q = max(fb.extend_seq_lens_cpu)
            qlen = fb.extend_seq_lens
            starts = torch.cumsum(qlen, 0) - qlen
            ar_q = torch.arange(max_q, device=device)
            q_valid = ar_q[None, :] < qlen[:, None]  # [B, max_q]
            total = fb.input_ids.shape[0]
            q_idx = torch.where(q_valid, starts[:, None] + ar_q, total)
            q_pos = fb.extend_prefix_lens[:, None] + ar_q  # absolute position of each query row
            mask = (ar_kv[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
            # Padding rows attend to slot 0 so no row is fully masked (that would give NaN); they are dropped after.
            mask[:, :, 0] |= ~q_valid
            out_idx = (torch.arange(fb.batch_size, device=device)[:, None] * max_q + ar_q)[q_valid]
            fb.attn_metadata = TorchNativeMetadata(kv_idx, mask[:, None], q_idx, out_idx)

    # index_select rather than tensor[idx]: on CPU advanced indexing is several times slower.
    @staticmethod
    def _gather_kv(pool, layer, kv_idx: torch.Tensor, dtype: torch.dtype):
        """K and V of every request's tokens, [B, KVH, max_kv, D]."""
        b, n = kv_idx.shape
        flat = kv_idx.view(-1)
        k = gather_rows(pool.k_buffer[layer.layer_id], flat).view(b, n, layer.num_kv_heads, -1)
        v = gather_rows(pool.v_buffer[layer.layer_id], flat).view(b, n, layer.num_kv_heads, -1)
        if pool.is_fp8:  # e4m3 times the layer's scales
            k = k.float() * pool.k_scale[layer.layer_id]
            v = v.float() * pool.v_scale[layer.layer_id]
        return k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)

    def forward_extend(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        meta = fb.attn_metadata
        if isinstance(meta, CpuDecodeMetadata):
            return self._c_rows(q, layer, fb, meta.rows, meta.seq_lens, meta.max_len)
        keys, values = self._gather_kv(fb.token_to_kv_pool, layer, meta.kv_idx, q.dtype)
        b, max_q = meta.q_idx.shape
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])]).index_select(0, meta.q_idx.view(-1))
        q_pad = q_pad.view(b, max_q, *q.shape[1:]).transpose(1, 2)  # [B, H, max_q, D]
        out = self._sdpa(q_pad, keys, values, meta.mask, layer)
        return out.transpose(1, 2).reshape(b * max_q, -1).index_select(0, meta.out_idx)

    def forward_decode(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        meta = fb.attn_metadata
        if isinstance(meta, CpuDecodeMetadata):
            return self._c_rows(q, layer, fb, fb.req_pool_indices, fb.seq_lens, meta.max_len)
        keys, values = self._gather_kv(fb.token_to_kv_pool, layer, meta.kv_idx, q.dtype)
        out = self._sdpa(q[:, :, None, :], keys, values, meta.mask, layer)
        return out.reshape(q.shape[0], -1)

    @staticmethod
    def _c_rows(q, layer, fb: ForwardBatch, rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        return cpu_kernels.decode_attention(
            q.float(),
            pool.k_buffer[layer.layer_id],
            pool.v_buffer[layer.layer_id],
            fb.req_to_token_pool.req_to_token,
            rows,
            seq_lens,
            max_len,
            layer.scaling,
        )

    def _sdpa(self, q, keys, values, mask, layer) -> torch.Tensor:
        """SDPA over query-row slices small enough that a kernel materializing the [B, H, q, kv] scores
        (the math path) stays within _SCORE_BUDGET bytes; one slice in the common case."""
        gqa = layer.num_heads != layer.num_kv_heads
        if gqa and q.is_cuda:
            # The memory-efficient CUDA kernel takes a mask but not enable_gqa; with both it falls back to
            # the math path, whose scores for a long prefill run to many GiB.
            groups = layer.num_heads // layer.num_kv_heads
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
            gqa = False
        b, h, nq, _ = q.shape
        rows = max(1, _SCORE_BUDGET // (b * h * keys.shape[2] * 4))
        outs = [
            F.scaled_dot_product_attention(
                q[:, :, s : s + rows],
                keys,
                values,
                attn_mask=mask[:, :, s : s + rows],
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            for s in range(0, nq, rows)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
