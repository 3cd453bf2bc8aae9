"""Typed messages between the tokenizer manager, scheduler and detokenizer: msgspec structs, msgpack on the
wire (never pickle from a socket). One tagged union per direction."""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class FinishReason(msgspec.Struct, omit_defaults=True):
    """Why a request ended. `type`: stop (an EOS or stop token id, a stop string, or a complete grammar:
    `matched` says which, None for a grammar), length (`length` tokens generated), abort (a client's abort, or
    a failure carrying the HTTP `status_code` to answer with and the request `param` at fault)."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    param: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None = None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, n: int) -> FinishReason:
        return cls("length", length=n)

    @classmethod
    def abort(
        cls, message: str = "request aborted", status_code: int | None = None, param: str | None = None
    ) -> FinishReason:
        return cls("abort", message=message, status_code=status_code, param=param)

    @property
    def failed(self) -> bool:
        """Ended by an error (not by a stop, a length or a client's abort)."""
        return bool(self.status_code)

    def to_dict(self) -> dict:
        """The public form (the native API's meta_info.finish_reason, as SGLang reports it)."""
        d: dict = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        for name in ("length", "message", "status_code", "param"):
            value = getattr(self, name)
            if value is not None:
                d[name] = value
        return d


class TokenOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's progress in one scheduler step. The scheduler fills the ids; the detokenizer adds `delta`
    (the new text) and passes the same struct on to the tokenizer manager."""

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    delta: str = ""
    finished_reason: FinishReason | None = None
    # (logprob, token_id) per token; prompt entries start at logprob_start_len, the first prompt token has None.
    input_logprobs: list[tuple[float | None, int]] | None = None
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    # Sent with a request's first output so the detokenizer knows how to render it.
    detok: dict | None = None
    # Speculative decoding, so far: (verify steps with a draft, draft tokens, draft tokens accepted); None without.
    spec: tuple[int, int, int] | None = None

    @property
    def failed(self) -> bool:
        """The final update of a request ended by an error (it carries the HTTP status to answer with)."""
        return self.finished_reason is not None and self.finished_reason.failed


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
    """flush_cache | get_stats | shutdown | start_profile | stop_profile; answered with a ControlResp carrying
    the same id. `args`: the request's arguments (start_profile's)."""

    id: int
    kind: str
    args: Optional[dict] = None


SchedulerIn = Union[GenerateReq, AbortReq, ControlReq]


# --- scheduler -> detokenizer --------------------------------------------------------------------------------
class BatchTokenOutput(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]


# --- detokenizer / scheduler -> tokenizer manager ----------------------------------------------------------
class BatchStrOutput(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]  # with `delta` set and `detok` dropped


class ControlResp(msgspec.Struct, tag=True):
    id: int
    ok: bool
    payload: Any = None


TokenizerIn = Union[BatchStrOutput, ControlResp]


def spec_meta(spec: tuple[int, int, int]) -> dict:
    """meta_info's speculative-decoding fields from TokenOutput.spec (as SGLang names the verify count)."""
    steps, drafted, accepted = spec
    return {
        "spec_verify_ct": steps,
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_accept_rate": accepted / drafted if drafted else 0.0,
    }
