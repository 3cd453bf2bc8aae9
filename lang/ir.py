"""What a program appends to its state: text, role blocks and the primitives `gen` and `select`.

These are plain values; the interpreter (`interpreter.py`) gives them meaning. `"text" + gen(...)` builds a
`Seq`, so SGLang-style one-liners such as `s += "Q: " + q + "\\nA:" + gen("a")` work.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

# What `gen(dtype=...)` (and gen_int / gen_string) constrains a generation to: SGLang's patterns, so programs that
# import them, or rely on what they accept, behave the same. int and float also stop at the first space or newline
# (see dtype_constraint), which is why they allow trailing whitespace: the stop string ends the value there.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""


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
_PARAM_KEYS = (
    "max_tokens",
    "min_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "seed",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "dtype",
    "regex",
    "json_schema",
)


@dataclass
class Gen(Expr):
    name: str | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # applied by the interpreter (lang/generation.py)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    # request options rather than sampling parameters; backends take them apart (backend/base.py)
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None  # int, float, str, bool (or their names): becomes a regex, see dtype_constraint
    regex: str | None = None
    json_schema: Any = None
    choices: list[str] | None = None  # gen with choices is a select
    choices_method: ChoicesMethod = token_length_normalized

    def sampling_params(self) -> dict:
        """This gen's own settings (the program's run() defaults fill in the rest), native names."""
        return {_PARAM_NAMES.get(k, k): getattr(self, k) for k in _PARAM_KEYS if getattr(self, k) is not None}


def dtype_constraint(dtype) -> tuple[str, list[str]]:
    """The regex a `gen(dtype=...)` is held to and the stop strings it adds (SGLang's meaning: a number ends at the
    first space or newline)."""
    if dtype in (int, "int"):
        return REGEX_INT, [" ", "\n"]
    if dtype in (float, "float"):
        return REGEX_FLOAT, [" ", "\n"]
    if dtype in (str, "str", "string"):
        return REGEX_STR, []
    if dtype in (bool, "bool"):
        return REGEX_BOOL, []
    raise ValueError(f"gen(dtype={dtype!r}): dtype must be int, float, str or bool")


def resolve_dtype(params: dict) -> dict:
    """Turn a `dtype` entry of merged gen parameters into the regex and stop strings it stands for."""
    if params.get("dtype") is None:
        params.pop("dtype", None)
        return params
    regex, stops = dtype_constraint(params.pop("dtype"))
    if params.get("regex") is not None and params["regex"] != regex:
        warnings.warn(f"gen() got both dtype and regex: the dtype's pattern {regex!r} is used", stacklevel=2)
    params["regex"] = regex
    if stops:
        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        params["stop"] = stop + [x for x in stops if x not in stop]
    return params


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
