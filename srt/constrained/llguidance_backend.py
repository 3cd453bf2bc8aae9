"""llguidance: JSON schema, regex, Lark and GBNF grammars through an Earley parser over a lexer, with masks
computed lazily per step and forced ("fast-forward") bytes for jump-forward.

It refuses JSON-schema keywords it does not implement ("Unimplemented keys: [...]") instead of dropping them, so
what it accepts it enforces; grammars build in about a millisecond, so a compile is a validation plus a template
matcher that each request copies."""

from __future__ import annotations

import functools
import json
import os
import re

import torch

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec, Matcher
from radixlm.srt.constrained.schema_support import anchor_patterns
from radixlm.srt.constrained.tool_grammar import BEGIN, END, not_prefixed_regex, parse_spec
from radixlm.srt.errors import GrammarError

# Compact JSON with one space after separators, as the xgrammar backend writes it; no free whitespace, which a
# small model would otherwise fill with newlines until its token limit.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def json_grammar(schema_text: str) -> str:
    from llguidance import LLMatcher

    schema = json.loads(schema_text)
    if isinstance(schema, dict):
        schema = anchor_patterns(schema)
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def grammar_for(spec: GrammarSpec) -> str:
    """The llguidance grammar (its serialized form) of a spec; ValueError for text it cannot even read."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind == "json_schema":
        return json_grammar(spec.spec)
    if spec.kind == "json_object":
        return json_grammar(json.dumps({"type": "object"}))
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choices":
        return grammar_from("choice", spec.spec)
    if spec.kind == "ebnf":
        return grammar_from("gbnf", spec.spec)  # GBNF (the xgrammar backend's syntax) or Lark
    if spec.kind == "tool_call":
        mode, schema = parse_spec(spec.spec)
        body = json.dumps({**anchor_patterns(schema), "x-guidance": JSON_OPTIONS})  # a call's schema: an object
        call = f"call: {_lark_string(BEGIN)} %json {body} {_lark_string(END)}"
        if mode == "call":
            return LLMatcher.grammar_from_lark(f"start: call\n{call}\n")
        text = not_prefixed_regex(BEGIN)
        return LLMatcher.grammar_from_lark(f"start: call | TEXT\nTEXT: /{text}/\n{call}\n")
    raise GrammarError(f"unknown grammar kind {spec.kind!r}", param=spec.kind)


def check(spec: GrammarSpec) -> str | None:
    """Why llguidance would refuse this spec (its own message), or None: its grammar checks need no tokenizer,
    so the edge can ask before anything is compiled."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_for(spec)
    except (ValueError, GrammarError) as e:
        return str(e) or type(e).__name__
    err = LLMatcher.validate_grammar(grammar)
    return err or None


def one_line(message: str) -> str:
    """llguidance's error messages draw the grammar source under them; keep the first line and the parser's own
    `error:` line."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return "invalid grammar"
    why = next((ln for ln in lines[1:] if ln.startswith("error:")), None)
    return lines[0] if why is None else f"{lines[0].rstrip(':')}: {why[len('error:') :].strip()}"


def unimplemented_keys(message: str) -> list[str]:
    """The keywords an llguidance refusal names ('Unimplemented keys: ["not", "if"]'), if any."""
    m = _UNIMPLEMENTED.search(message)
    return [k.strip().strip('"') for k in m.group(1).split(",")] if m else []


class LLGuidanceCompiled(CompiledGrammar):
    def __init__(self, template):
        self.template = template  # a matcher at the start state: each request gets a copy

    def matcher(self) -> Matcher:
        return LLGuidanceMatcher(self.template.deep_copy())


class LLGuidanceMatcher(Matcher):
    def __init__(self, m):
        self.m = m

    def accept(self, token: int) -> bool:
        # try_consume_tokens leaves the matcher as it was when it refuses the token (consume_token would put it in
        # an error state it never leaves)
        return self.m.try_consume_tokens([token]) == 1

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self.m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def rollback(self, n: int) -> None:
        if n > 0:
            self.m.rollback(n)

    def forced_continuation(self) -> str:
        return self.m.compute_ff_bytes().decode("utf-8", errors="ignore")

    @classmethod
    def fill_masks(cls, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call on llguidance's own thread pool, without the GIL (a 128k-token row takes tens of
        microseconds: a batch of 64 one by one would take milliseconds of the step)."""
        view = bitmask if bitmask.is_contiguous() else None
        if view is None or len(rows) < 2:
            return super().fill_masks(rows, bitmask)
        _executor().unsafe_compute_mask_ptr(
            [(m.m, row) for m, row in rows], view.data_ptr(), view.shape[1] * 4, view.shape[0]
        )


@functools.cache
def _executor():
    from llguidance import LLExecutor

    return LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(set(stop_ids)))

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        param = {"json_object": "response_format", "tool_call": "tools"}.get(spec.kind, spec.kind)
        try:
            grammar = grammar_for(spec)
        except ValueError as e:
            raise GrammarError(f"the {spec.describe()} cannot be compiled: {e}", param=param) from None
        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the {spec.describe()} cannot be compiled: {one_line(m.get_error())}", param=param)
        return LLGuidanceCompiled(m)
