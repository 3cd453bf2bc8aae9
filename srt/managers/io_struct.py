"""Typed messages between the tokenizer manager, scheduler and detokenizer (msgspec structs, msgpack on the wire)."""
from __future__ import annotations

import msgspec


class TokenOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one scheduler step."""

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished_reason: dict | None = None
    # (logprob, token_id) per token; prompt entries start at logprob_start_len, the first prompt token has None.
    input_logprobs: list[tuple[float | None, int]] | None = None
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
