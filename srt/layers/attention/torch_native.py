"""Attention with torch's scaled_dot_product_attention over K/V gathered from the paged pool.

Works on CPU and CUDA. Requests are padded to the batch's longest query/KV length so that one SDPA
call serves the whole batch (no Python loop over requests); masks carry causality and raggedness.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.srt.layers.attention.base import AttentionBackend
from radixlm.srt.model_executor.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        device = fb.seq_lens.device
        max_kv = max(fb.seq_lens_cpu)
        rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_kv].long()
        ar_kv = torch.arange(max_kv, device=device)
        kv_valid = ar_kv[None, :] < fb.seq_lens[:, None]  # [B, max_kv]
        meta = {"kv_idx": torch.where(kv_valid, rows, 0)}
        if fb.mode.is_decode:
            meta["mask"] = kv_valid[:, None, None, :]
        else:
            max_q = max(fb.extend_seq_lens_cpu)
            qlen = fb.extend_seq_lens
            starts = torch.cumsum(qlen, 0) - qlen
            ar_q = torch.arange(max_q, device=device)
            q_valid = ar_q[None, :] < qlen[:, None]  # [B, max_q]
            total = fb.input_ids.shape[0]
            meta["q_idx"] = torch.where(q_valid, starts[:, None] + ar_q, total)
            q_pos = fb.extend_prefix_lens[:, None] + ar_q  # absolute position of each query row
            mask = (ar_kv[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
            # Padding rows attend to slot 0 so no row is fully masked (that would give NaN); they are dropped after.
            mask[:, :, 0] |= ~q_valid
            meta["mask"] = mask[:, None]
            b = fb.batch_size
            meta["out_idx"] = (torch.arange(b, device=device)[:, None] * max_q + ar_q)[q_valid]
            meta["max_q"] = max_q
        fb.attn_metadata = meta

    def forward_extend(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        meta = fb.attn_metadata
        pool = fb.token_to_kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        keys = pool.k_buffer[layer.layer_id][meta["kv_idx"]].transpose(1, 2)  # [B, KVH, max_kv, D]
        values = pool.v_buffer[layer.layer_id][meta["kv_idx"]].transpose(1, 2)
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta["q_idx"]].transpose(1, 2)  # [B, H, max_q, D]
        out = F.scaled_dot_product_attention(q_pad, keys.to(q.dtype), values.to(q.dtype), attn_mask=meta["mask"],
                                             scale=layer.scaling, enable_gqa=layer.num_heads != layer.num_kv_heads)
        out = out.transpose(1, 2).reshape(fb.batch_size * meta["max_q"], -1)
        return out[meta["out_idx"]]

    def forward_decode(self, q, k, v, layer, fb: ForwardBatch) -> torch.Tensor:
        meta = fb.attn_metadata
        pool = fb.token_to_kv_pool
        pool.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        keys = pool.k_buffer[layer.layer_id][meta["kv_idx"]].transpose(1, 2)
        values = pool.v_buffer[layer.layer_id][meta["kv_idx"]].transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=meta["mask"], scale=layer.scaling,
                                             enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.reshape(q.shape[0], -1)
