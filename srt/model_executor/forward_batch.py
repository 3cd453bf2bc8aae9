"""The model's view of a batch: tensors only, built once per step by the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


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
    # Rows of the hidden states that need logits (last token of each request, plus prompt rows for logprobs).
    logits_indices: torch.Tensor
    extend_prefix_lens: torch.Tensor | None = None  # [B]
    extend_seq_lens: torch.Tensor | None = None  # [B]
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # Filled in by the model runner.
    req_to_token_pool: object = None
    token_to_kv_pool: object = None
    attn_backend: object = None
    attn_metadata: dict = field(default_factory=dict)

    @classmethod
    def build(cls, mode: ForwardMode, device: torch.device, *, input_ids: list[int], positions: list[int],
              req_pool_indices: list[int], seq_lens: list[int], out_cache_loc: torch.Tensor,
              logits_indices: list[int], extend_prefix_lens: list[int] | None = None,
              extend_seq_lens: list[int] | None = None) -> "ForwardBatch":
        def t(x):
            return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            mode=mode, batch_size=len(seq_lens), input_ids=t(input_ids), positions=t(positions),
            req_pool_indices=t(req_pool_indices), seq_lens=t(seq_lens),
            out_cache_loc=out_cache_loc.to(device, non_blocking=True), seq_lens_cpu=seq_lens,
            logits_indices=t(logits_indices),
            extend_prefix_lens=None if extend_prefix_lens is None else t(extend_prefix_lens),
            extend_seq_lens=None if extend_seq_lens is None else t(extend_seq_lens),
            extend_prefix_lens_cpu=extend_prefix_lens, extend_seq_lens_cpu=extend_seq_lens,
        )
