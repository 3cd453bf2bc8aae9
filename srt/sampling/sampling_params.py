"""Per-request sampling parameters, validated once where a request enters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from radixlm.srt.errors import InvalidRequest

_MAX_STOP_STRINGS = 16
_MAX_N = 128


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param}: {message}", param=param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    # Constrained decoding (at most one): a JSON schema (object or JSON text), a regex, an EBNF grammar.
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    tool_call: str | None = None  # a tool-call grammar spec (set by the OpenAI layer for `tools`)

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        """Build from user input; unknown keys are an error naming them, so typos never pass silently."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}", param=unknown[0])
        params = cls(**{k: v for k, v in d.items() if v is not None or k in ("max_new_tokens", "seed")})
        params.validate()
        return params

    def validate(self) -> None:
        if self.max_new_tokens is not None:
            _check(
                _is_int(self.max_new_tokens) and self.max_new_tokens >= 0,
                "max_new_tokens",
                f"must be an integer >= 0, got {self.max_new_tokens!r}",
            )
        _check(
            _is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens",
            f"must be an integer >= 0, got {self.min_new_tokens!r}",
        )
        _check(
            _is_num(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be a number >= 0, got {self.temperature!r}",
        )
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}",
        )
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        _check(
            _is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            f"must be in (0, 2], got {self.repetition_penalty!r}",
        )
        _check(_is_int(self.n) and 1 <= self.n <= _MAX_N, "n", f"must be an integer in [1, {_MAX_N}], got {self.n!r}")
        if self.seed is not None:
            _check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(
            isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a non-empty string or a list of non-empty strings",
        )
        _check(len(self.stop) <= _MAX_STOP_STRINGS, "stop", f"at most {_MAX_STOP_STRINGS} stop strings")
        _check(
            isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            _check(isinstance(getattr(self, name), bool), name, "must be a boolean")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to numbers")
            bias = {}
            for k, v in self.logit_bias.items():
                tid = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
                _check(_is_int(tid) and tid >= 0, "logit_bias", f"keys must be token ids, got {k!r}")
                _check(_is_num(v) and -100 <= v <= 100, "logit_bias", f"values must be in [-100, 100], got {v!r}")
                bias[tid] = float(v)
            self.logit_bias = bias or None
        if self.top_k == 0:
            self.top_k = -1
        spec = self.grammar()  # raises GrammarError (400) naming the problem
        if spec is not None and spec.kind == "json_schema":
            self.json_schema = spec.spec  # canonical text: what crosses the wire and keys the grammar cache

    def grammar(self):
        """The request's grammar as a GrammarSpec, or None when unconstrained."""
        from radixlm.srt.constrained.spec import grammar_spec

        return grammar_spec(self.json_schema, self.regex, self.ebnf, self.tool_call)

    def has_penalties(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
