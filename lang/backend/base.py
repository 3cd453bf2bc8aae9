"""The interface the interpreter talks to. The language never reaches into the runtime's internals."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from radixlm.lang.chat_template import RoleMarkers


class LangError(RuntimeError):
    """A program used the language wrongly, or its backend refused or failed."""


@dataclass
class GenResult:
    text: str
    meta: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, cached_tokens, finish_reason


@dataclass
class Call:
    """One generation: the prompt so far (and, for chat APIs, the turns so far) and sampling parameters."""
    text: str
    params: dict
    messages: list[dict] = field(default_factory=list)  # finished turns
    role: str | None = None  # the open role block, if any
    role_text: str = ""  # what that block holds so far


class Backend:
    def role_markers(self) -> RoleMarkers:
        return RoleMarkers.plain()

    def generate(self, call: Call) -> GenResult:
        raise NotImplementedError

    def stream(self, call: Call) -> Iterator[tuple[str, GenResult | None]]:
        """(new text, None) pieces, then ("", the final result)."""
        res = self.generate(call)
        yield res.text, None
        yield "", res

    def select(self, call: Call, choices: list[str], method, temperature: float) -> tuple[int, dict]:
        """The index of the chosen continuation and what it was chosen from (scores, logprobs)."""
        raise NotImplementedError

    def commit_prefix(self, text: str) -> None:
        """Make `text` cached before several branches that start with it run (fork)."""

    def shutdown(self) -> None:
        pass
