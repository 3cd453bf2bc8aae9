"""The model's view of a batch: tensors only, built once per step from the scheduler's host lists.

Every index the batch needs travels to the device in one packed copy. Input ids may be *futures*: a negative
id -(j + 1) stands for the token sampled into slot j of the runner's future map by an earlier step that the
host has not read back yet (overlap scheduling); they are resolved on the device, with no round trip.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixlm.srt.model_executor.host_transfer import pinned_empty

if TYPE_CHECKING:
    from radixlm.srt.layers.attention.base import AttentionBackend
    from radixlm.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


def resolve_futures(ids: torch.Tensor, future_map: torch.Tensor) -> torch.Tensor:
    """`ids` with every future (negative) swapped for the token it stands for, on the device."""
    return torch.where(ids < 0, future_map[(-ids - 1).clamp(0, future_map.shape[0] - 1)], ids)


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # new tokens (prompts or chunks of them) attending to a cached prefix and themselves
    DECODE = 2  # one new token per request

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B], lengths after this forward
    out_cache_loc: torch.Tensor  # [T], KV slots the new tokens write to
    seq_lens_cpu: list[int]
    # Rows of the hidden states that need logits (last token of each request, plus prompt rows for logprobs);
    # None: every row (decode).
    logits_indices: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None  # [B]
    extend_seq_lens: torch.Tensor | None = None  # [B]
    extend_start_loc: torch.Tensor | None = None  # [B], where each request's new tokens start in the batch
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    req_pool_indices_cpu: list[int] | None = None
    # Filled in by the model runner.
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: TokenToKVPool | None = None
    attn_backend: AttentionBackend | None = None
    attn_metadata: Any = None  # the backend's own typed metadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        device: torch.device,
        *,
        input_ids: list[int],
        positions: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        logits_indices: list[int] | None = None,
        extend_prefix_lens: list[int] | None = None,
        extend_seq_lens: list[int] | None = None,
        future_map: torch.Tensor | None = None,
    ) -> "ForwardBatch":
        t, b = len(input_ids), len(seq_lens)
        extend = extend_seq_lens is not None
        starts = []
        if extend:
            acc = 0
            for n in extend_seq_lens:
                starts.append(acc)
                acc += n
        parts: list = [input_ids, positions, req_pool_indices, seq_lens]
        if extend:
            parts += [extend_prefix_lens, extend_seq_lens, starts]
        if logits_indices is not None:
            parts.append(logits_indices)
        flat = [x for p in parts for x in p]
        host = (
            pinned_empty(len(flat) + t, torch.int64, device)
            if device.type == "cuda"
            else torch.empty(len(flat) + t, dtype=torch.int64)
        )
        host[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
        host[len(flat) :] = out_cache_loc
        dev = host.to(device, non_blocking=True)
        sizes = (
            [t, t, b, b]
            + ([b, b, b] if extend else [])
            + ([len(logits_indices)] if logits_indices is not None else [])
            + [t]
        )
        views = list(dev.split(sizes))
        ids = views[0]
        if future_map is not None and any(i < 0 for i in input_ids):
            ids = resolve_futures(ids, future_map)
        fb = cls(
            mode=mode,
            batch_size=b,
            input_ids=ids,
            positions=views[1],
            req_pool_indices=views[2],
            seq_lens=views[3],
            out_cache_loc=views[-1],
            seq_lens_cpu=list(seq_lens),
            req_pool_indices_cpu=list(req_pool_indices),
        )
        i = 4
        if extend:
            fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc = views[4:7]
            fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(extend_prefix_lens), list(extend_seq_lens)
            i = 7
        if logits_indices is not None:
            fb.logits_indices = views[i]
        return fb


@dataclass
class BatchSpec:
    """The host-side description of a batch, from which the runner builds a ForwardBatch or fills a CUDA
    graph's static buffers."""

    mode: ForwardMode
    input_ids: list[int]  # negative: a future (see the module docstring)
    positions: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    out_cache_loc: torch.Tensor  # host int64
    logits_indices: list[int] | None = None
    extend_prefix_lens: list[int] | None = None
    extend_seq_lens: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    def has_futures(self) -> bool:
        return any(i < 0 for i in self.input_ids)

    def build(self, device: torch.device, future_map: torch.Tensor | None) -> ForwardBatch:
        return ForwardBatch.build(
            self.mode,
            device,
            input_ids=self.input_ids,
            positions=self.positions,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            out_cache_loc=self.out_cache_loc,
            logits_indices=self.logits_indices,
            extend_prefix_lens=self.extend_prefix_lens,
            extend_seq_lens=self.extend_seq_lens,
            future_map=future_map,
        )
