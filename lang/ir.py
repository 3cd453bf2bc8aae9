"""What a program appends to its state: text, role blocks and the primitives `gen` and `select`.

These are plain values; the interpreter (`interpreter.py`) gives them meaning. `"text" + gen(...)` builds a
`Seq`, so SGLang-style one-liners such as `s += "Q: " + q + "\\nA:" + gen("a")` work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Expr:
    """Anything that can be appended to a state; `+` chains them in order."""

    def __add__(self, other) -> "Seq":
        return Seq([self, other])

    def __radd__(self, other) -> "Seq":
        return Seq([other, self])


@dataclass
class Seq(Expr):
    items: list

    def __add__(self, other) -> "Seq":
        return Seq([*self.items, other])

    def __radd__(self, other) -> "Seq":
        return Seq([other, *self.items])


@dataclass(frozen=True)
class ChoicesMethod:
    """How `select` turns each choice's token logprobs into a score (see choices.py)."""
    name: str


token_length_normalized = ChoicesMethod("token_length_normalized")
greedy_token_selection = ChoicesMethod("greedy_token_selection")
unconditional_likelihood_normalized = ChoicesMethod("unconditional_likelihood_normalized")

# gen(...) argument -> native sampling parameter
_PARAM_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


@dataclass
class Gen(Expr):
    name: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: Any = None
    choices: list[str] | None = None  # gen with choices is a select
    choices_method: ChoicesMethod = token_length_normalized

    def sampling_params(self) -> dict:
        out = {}
        for key in ("max_tokens", "min_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "regex",
                    "json_schema"):
            value = getattr(self, key)
            if value is not None:
                out[_PARAM_NAMES.get(key, key)] = value
        return out


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    choices_method: ChoicesMethod = token_length_normalized
    temperature: float = 0.0


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class Role(Expr):
    """`system(...)`, `user(...)`, `assistant(...)`: a whole turn; the content may hold primitives."""
    role: str
    content: list = field(default_factory=list)


@dataclass
class Image(Expr):
    path: str


@dataclass
class VarScopeBegin(Expr):
    name: str


@dataclass
class VarScopeEnd(Expr):
    name: str
