"""The interface every grammar backend implements.

A backend compiles a spec into a reusable CompiledGrammar (shared by every request with the same spec); each
request gets its own Matcher, which follows the tokens it accepts and fills that request's row of the batch's
token bitmask (int32 words, bit j of word w allows token 32 * w + j; the layout outlines-core and xgrammar
share)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "choices", "json_object", "tool_call")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of GRAMMAR_KINDS
    spec: str  # canonical text: a JSON schema (sorted keys), a regex, EBNF, a JSON list of choices, ""

    def describe(self) -> str:
        return {
            "json_schema": "JSON schema",
            "regex": "regex",
            "ebnf": "EBNF grammar",
            "choices": "choice list",
            "json_object": "JSON object",
            "tool_call": "tool-call grammar",
        }[self.kind]


class Matcher(ABC):
    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (a host int32 tensor [B, ceil(V / 32)])."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and nothing but a stop token may follow (or a stop token was accepted)."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""

    def forced_continuation(self) -> str:
        """Text the grammar allows as the only continuation from here (jump-forward); '' if none."""
        return ""

    @classmethod
    def fill_masks(cls, rows: list[tuple["Matcher", int]], bitmask: torch.Tensor) -> None:
        """fill_mask for many matchers of this class at once (a backend with a batched, multithreaded fill
        overrides it)."""
        for m, row in rows:
            m.fill_mask(bitmask, row)


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> Matcher: ...


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile or raise GrammarError naming what is wrong; may take long: runs in a worker thread."""

    def promotion(self, spec: GrammarSpec) -> "GrammarBackend | None":
        """Where later requests for a spec seen before may move once it has compiled there (a backend with cheaper
        masks per step and the same language); None to stay."""
        return None


def popcount_row(bitmask: torch.Tensor, row: int) -> int:
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    return int(sum(bin(w).count("1") for w in words[words != 0].tolist()))
