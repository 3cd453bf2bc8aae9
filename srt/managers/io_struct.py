"""Typed messages between the tokenizer manager, scheduler and detokenizer: msgspec structs, msgpack on the
wire (never pickle from a socket). One tagged union per direction."""
from __future__ import annotations

from typing import Any, Union

import msgspec


class TokenOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one scheduler step. The scheduler fills the ids; the detokenizer adds `delta`
    (the new text) and passes the same struct on to the tokenizer manager."""

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    delta: str = ""
    finished_reason: dict | None = None
    # (logprob, token_id) per token; prompt entries start at logprob_start_len, the first prompt token has None.
    input_logprobs: list[tuple[float | None, int]] | None = None
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Sent with a request's first output so the detokenizer knows how to render it.
    detok: dict | None = None

    @property
    def failed(self) -> bool:
        """The final update of a request ended by an error (it carries the HTTP status to answer with)."""
        return bool((self.finished_reason or {}).get("status_code"))


# --- tokenizer manager -> scheduler ----------------------------------------------------------------------
class GenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: dict
    seed: int
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    stream: bool = False


class AbortReq(msgspec.Struct, tag=True):
    rid: str


class ControlReq(msgspec.Struct, tag=True):
    """flush_cache | get_stats | shutdown; answered with a ControlResp carrying the same id."""

    id: int
    kind: str


SchedulerIn = Union[GenerateReq, AbortReq, ControlReq]


# --- scheduler -> detokenizer --------------------------------------------------------------------------------
class BatchTokenOutput(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]
    sent_at: float = 0.0  # the scheduler's perf_counter (CLOCK_MONOTONIC, one clock for all processes) at send


# --- detokenizer / scheduler -> tokenizer manager ----------------------------------------------------------
class BatchStrOutput(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]  # with `delta` set and `detok` dropped
    sched_at: float = 0.0  # when the scheduler sent these tokens
    detok_at: float = 0.0  # when the detokenizer sent them on


class ControlResp(msgspec.Struct, tag=True):
    id: int
    ok: bool
    payload: Any = None


TokenizerIn = Union[BatchStrOutput, ControlResp]
