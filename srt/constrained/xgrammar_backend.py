"""xgrammar: JSON schema, regex, EBNF (GBNF-style), any-JSON, compiled to a pushdown automaton with fast masks,
native jump-forward strings and rollback."""

from __future__ import annotations

import functools
import json
import os

import torch

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec, Matcher, popcount_row
from radixlm.srt.constrained.outlines_backend import choices_regex
from radixlm.srt.errors import GrammarError

_MAX_ROLLBACK = 64
# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (minLength / maxLength) as this class, which
# lets raw control characters through (JSON requires them escaped: such output does not parse). The same class
# without U+0000-U+001F replaces it.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled, backend: "XGrammarBackend"):
        self.compiled = compiled
        self.backend = backend

    def matcher(self) -> Matcher:
        return XGrammarMatcher(self)


class XGrammarMatcher(Matcher):
    def __init__(self, c: XGrammarCompiled):
        import xgrammar

        self.b = c.backend
        self.m = xgrammar.GrammarMatcher(c.compiled, max_rollback_tokens=_MAX_ROLLBACK)

    def accept(self, token: int) -> bool:
        return not self.m.is_terminated() and self.m.accept_token(token)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        if self.m.is_terminated():
            return True
        if not self.m.is_completed():
            return False
        # Complete; terminated if only stop tokens may follow.
        scratch = self.b.scratch
        self.m.fill_next_token_bitmask(scratch, 0)
        return popcount_row(scratch, 0) <= self.b.allowed_stop_count(scratch)

    def rollback(self, n: int) -> None:
        if n > 0:
            self.m.rollback(n)

    def forced_continuation(self) -> str:
        return self.m.find_jump_forward_string()

    @classmethod
    def fill_masks(cls, rows: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call on xgrammar's own threads (BatchGrammarMatcher)."""
        if len(rows) < 2:
            return super().fill_masks(rows, bitmask)
        _batch_matcher().batch_fill_next_token_bitmask(
            [m.m for m, _ in rows], bitmask, indices=[row for _, row in rows]
        )


@functools.cache
def _batch_matcher():
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], threads: int = 1):
        import xgrammar

        self.xgr = xgrammar
        self.stop_ids = sorted(set(stop_ids))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        # one thread: a compile's CPU priority can then be lowered as a whole (manager.DEMOTE_AFTER_S); parallelism
        # comes from compiling several grammars at once
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads)
        self.scratch = xgrammar.allocate_token_bitmask(1, vocab_size)

    def allowed_stop_count(self, bitmask: torch.Tensor) -> int:
        words = bitmask[0]
        return sum((int(words[t // 32]) >> (t % 32)) & 1 for t in self.stop_ids)

    def json_grammar(self, schema: str):
        """A JSON schema's grammar, its strings free of raw control characters."""
        grammar = self.xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        text = str(grammar)
        if _LOOSE_STRING_CHAR not in text:
            return grammar
        return self.xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))

    def _tool_grammar(self, spec: str):
        from radixlm.srt.constrained.tool_grammar import BEGIN, END, not_prefixed_regex, parse_spec, regex_escape

        G = self.xgr.Grammar
        mode, schema = parse_spec(spec)
        one = G.concat(
            G.from_regex(regex_escape(BEGIN)), self.json_grammar(json.dumps(schema)), G.from_regex(regex_escape(END))
        )
        calls = one  # one call per answer, as in the outlines backend
        return calls if mode == "call" else G.union(G.from_regex(not_prefixed_regex(BEGIN)), calls)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self.compiler
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.spec if spec.kind == "json_schema" else json.dumps({"type": "object"})
                compiled = c.compile_grammar(self.json_grammar(schema))
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.spec)
            elif spec.kind == "tool_call":
                compiled = c.compile_grammar(self._tool_grammar(spec.spec))
            elif spec.kind == "choices":
                compiled = c.compile_regex(choices_regex(json.loads(spec.spec)))
            else:
                compiled = c.compile_grammar(spec.spec)
        except Exception as e:  # RuntimeError with the parser's message
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            msg = msg.split("] ", 1)[-1]  # drop xgrammar's "[time] file:line:" prefix
            param = {"json_object": "response_format", "tool_call": "tools"}.get(spec.kind, spec.kind)
            raise GrammarError(f"the {spec.describe()} cannot be compiled: {msg}", param=param) from None
        return XGrammarCompiled(compiled, self)
