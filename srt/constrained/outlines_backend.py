"""outlines-core: regex and JSON schema (through its schema-to-regex translation) as a DFA indexed over our
tokenizer's vocabulary. No EBNF. It knows one EOS id; other stop ids are allowed wherever EOS is."""

from __future__ import annotations

import json
import re
import threading

import torch

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec, Matcher
from radixlm.srt.constrained.vocab import token_bytes
from radixlm.srt.errors import GrammarError

_MAX_ROLLBACK = 64
_JF_MAX_ALLOWED = 64  # a state allowing more tokens than this has no forced text worth looking for
_JF_MAX_CHARS = 256


# A whitespace pattern no schema's own text contains, handed to outlines-core's schema-to-regex translation to
# mark where it would allow optional whitespace; json_regex then writes JSON the way the other backends do.
_MARK = "[\u2063]?"


def json_regex(schema_text: str) -> str:
    """The JSON schema's regex with compact separators and one space after `:` and `,` (`{"a": 1, "b": [1, 2]}`),
    the text the llguidance and xgrammar backends allow, instead of outlines-core's optional space around every
    separator: the same request answers the same whatever backend compiles it, and a small model does not spend
    tokens on spaces. A schema whose own text contains the marker keeps outlines-core's whitespace."""
    from outlines_core.json_schema import build_regex_from_schema

    if "\u2063" in schema_text:
        return build_regex_from_schema(schema_text)
    regex = build_regex_from_schema(schema_text, _MARK)
    regex = regex.replace(f"{_MARK}:{_MARK}", ": ").replace(f"{_MARK},", ",")
    # One space after each comma: right after it, or past the group an optional property opens or closes there
    # (`,("zip": ...,)? "country"`), so that the text reads `, ` whether the optional property is there or not.
    regex = re.sub(r",(\(|\)\?)?" + re.escape(_MARK), lambda m: "," + (m.group(1) or "") + " ", regex)
    return _llguidance_scalars(regex.replace(_MARK, ""), schema_text)


# outlines-core's JSON strings and numbers differ from llguidance's in corners: it refuses U+0080-U+009F in a
# string and an exponent without a sign (`1e5`), and takes the escape `\/`. These rewrite its pieces to
# llguidance's language, so a schema enforced by both backends has one language (auto may move a repeated schema
# from llguidance to this backend). Only where the schema's own text cannot hold the same pieces (a `pattern`).
_SCALAR_REWRITES = (
    (r'[^"\\\x00-\x1F\x7F-\x9F]', r'[^"\\\x00-\x1F\x7F]', "x7F"),
    (r'\\["\\/bfnrt]', r'\\["\\bfnrt]', "bfnrt"),
    (r"([eE][+-][0-9]+)?", r"([eE][+-]?[0-9]+)?", "eE"),
)


def _llguidance_scalars(regex: str, schema_text: str) -> str:
    for old, new, guard in _SCALAR_REWRITES:
        if guard not in schema_text:
            regex = regex.replace(old, new)
    return regex


# outlines-core's index grows with bounded repetitions ({0,4096}) and with the regex; past these a build can take
# minutes and gigabytes (an optimisation such as auto's promotion should not start one)
_SMALL_INDEX_MAX_REGEX = 16_384
_SMALL_INDEX_MAX_REPEAT = 256
_BOUNDS = re.compile(r"\{(?:\d+,)?(\d+)\}")


def index_is_small(regex: str) -> bool:
    """Whether `regex` is one whose index builds in seconds at most, judged from its text."""
    if len(regex) > _SMALL_INDEX_MAX_REGEX:
        return False
    return all(int(n) <= _SMALL_INDEX_MAX_REPEAT for n in _BOUNDS.findall(regex))


def choices_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class OutlinesCompiled(CompiledGrammar):
    def __init__(self, index, backend: "OutlinesBackend"):
        self.index = index
        self.backend = backend

    def matcher(self) -> Matcher:
        return OutlinesMatcher(self)


class OutlinesMatcher(Matcher):
    def __init__(self, compiled: OutlinesCompiled):
        from outlines_core import Guide

        self.index = compiled.index
        self.b = compiled.backend
        self.guide = Guide(self.index, max_rollback=_MAX_ROLLBACK)
        self.stopped = False  # accepted a stop token at a final state

    def accept(self, token: int) -> bool:
        if self.stopped:
            return False
        if token in self.b.stop_ids:
            if self.guide.is_finished():
                self.stopped = True
                return True
            return False
        try:
            self.guide.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self.guide.write_mask_into(view.data_ptr(), view.numel(), 4)
        eos = self.b.eos_id
        if (int(view[eos // 32]) >> (eos % 32)) & 1:
            for t in self.b.stop_ids:  # every stop id may end the text where EOS may
                view[t // 32] |= _bit(t % 32)

    def is_terminated(self) -> bool:
        return self.stopped or (self.guide.is_finished() and self.guide.get_tokens() == [self.b.eos_id])

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if self.stopped:
            self.stopped = False
            n -= 1
        if n:
            self.guide.rollback_state(n)

    def forced_continuation(self) -> str:
        """Walk the DFA while every allowed token starts with the same bytes (and EOS is not allowed)."""
        state, out = self.guide.get_state(), b""
        idx, by_id, eos = self.index, self.b.tokens.by_id, self.b.eos_id
        while len(out) < _JF_MAX_CHARS:
            allowed = idx.get_allowed_tokens(state)
            if not allowed or len(allowed) > _JF_MAX_ALLOWED or eos in allowed:
                break
            texts = [by_id[t] for t in allowed if t in by_id]
            lcp = _common_prefix(texts)
            if not lcp:
                break
            exact = [t for t in allowed if by_id.get(t) == lcp]
            out += lcp
            if not exact:
                break
            state = idx.get_next_state(state, exact[0])
            if state is None:
                break
        return out.decode("utf-8", errors="ignore")


def _bit(j: int) -> int:
    return -(1 << 31) if j == 31 else 1 << j  # int32 words


def _common_prefix(texts: list[bytes]) -> bytes:
    if not texts:
        return b""
    lo, hi = min(texts), max(texts)
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        from outlines_core import Vocabulary

        self.tokens = token_bytes(tokenizer)
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else stop_ids[0]
        self.stop_ids = frozenset(stop_ids) | {self.eos_id}
        table: dict[bytes, list[int]] = {}
        for i, b in self.tokens.by_id.items():
            if i < vocab_size and i not in self.stop_ids:
                table.setdefault(b, []).append(i)
        self.vocabulary = Vocabulary(self.eos_id, table)
        # JSON grammars index a vocabulary without the tokens holding raw control characters: outlines-core puts a
        # string's `pattern` into the JSON regex as it is, so `.` or `[^a]` would let U+0000-U+001F into a string,
        # where JSON requires them escaped. Whitespace between JSON values is optional, so nothing needs them.
        self.json_vocabulary = Vocabulary(
            self.eos_id, {b: ids for b, ids in table.items() if not any(x < 0x20 for x in b)}
        )
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from outlines_core import Index

        regex = regex_for(spec)
        vocabulary = self.json_vocabulary if spec.kind in ("json_schema", "json_object") else self.vocabulary
        try:
            return OutlinesCompiled(Index(regex, vocabulary), self)
        except Exception as e:
            param = "regex" if spec.kind == "regex" else spec.kind
            raise GrammarError(f"the {spec.describe()} cannot be compiled: {e}", param=param) from None


def regex_for(spec: GrammarSpec) -> str:
    """The regex outlines-core indexes for `spec` (cheap next to the index itself); GrammarError if there is none."""
    if spec.kind == "ebnf":
        raise GrammarError(
            "EBNF grammars are not supported by the outlines grammar backend; start the "
            "server with --grammar-backend auto",
            param="ebnf",
        )
    if spec.kind == "regex":
        return spec.spec
    if spec.kind == "choices":
        return choices_regex(json.loads(spec.spec))
    if spec.kind == "json_object":
        return json_regex(json.dumps({"type": "object"}))
    if spec.kind == "tool_call":
        from radixlm.srt.constrained.tool_grammar import parse_spec, tool_call_regex

        try:
            return tool_call_regex(spec.spec, json_regex(json.dumps(parse_spec(spec.spec)[1])))
        except Exception as e:
            raise GrammarError(f"the tools' parameter schemas cannot be compiled: {e}", param="tools") from None
    try:
        return json_regex(spec.spec)
    except Exception as e:  # its errors are ValueErrors and Rust panics alike
        raise GrammarError(f"the JSON schema cannot be compiled: {e}", param="json_schema") from None
