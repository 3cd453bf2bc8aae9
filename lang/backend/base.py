"""The interface the interpreter talks to. The language never reaches into the runtime's internals."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from radixlm.lang.chat_template import RoleMarkers

# gen()/run() options that shape what a request returns rather than how it samples: the native API takes them
# beside `sampling_params`, the OpenAI API as `logprobs`/`top_logprobs`
REQUEST_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class LangError(RuntimeError):
    """A program used the language wrongly, or its backend refused or failed."""


@dataclass
class GenResult:
    text: str
    meta: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, cached_tokens, finish_reason
    samples: list[GenResult] | None = None  # with n > 1: every sample (text is the first one's)


@dataclass
class Call:
    """One generation: the prompt so far (and, for chat APIs, the turns so far) and sampling parameters."""

    text: str
    params: dict
    messages: list[dict] = field(default_factory=list)  # finished turns
    role: str | None = None  # the open role block, if any
    role_text: str = ""  # what that block holds so far

    def split(self) -> tuple[dict, dict]:
        """(sampling parameters, request options)."""
        return (
            {k: v for k, v in self.params.items() if k not in REQUEST_OPTIONS},
            {k: v for k, v in self.params.items() if k in REQUEST_OPTIONS},
        )


@dataclass
class TokenUsage:
    """Tokens a backend's requests have used (SGLang's `backend.token_usage`); run_batch threads add to it at once."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += int(prompt_tokens or 0)
            self.completion_tokens += int(completion_tokens or 0)

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


class Backend:
    # A chat-only API takes turns, not text: `gen` must open an assistant turn, and API speculative execution
    # (num_api_spec_tokens) generates a whole turn at once (lang/speculative.py).
    is_chat_model = False

    @property
    def token_usage(self) -> TokenUsage:
        usage = self.__dict__.get("_token_usage")
        if usage is None:  # made on first use, so subclasses need not call an __init__ for it
            usage = self.__dict__.setdefault("_token_usage", TokenUsage())
        return usage

    def role_markers(self) -> RoleMarkers:
        return RoleMarkers.plain()

    def get_model_name(self) -> str:
        raise NotImplementedError

    def generate(self, call: Call) -> GenResult:
        raise NotImplementedError

    def stream(self, call: Call) -> Iterator[tuple[str, GenResult | None]]:
        """(new text, None) pieces, then ("", the final result). Closing the iterator early ends the request."""
        res = self.generate(call)
        yield res.text, None
        yield "", res

    def select(self, call: Call, choices: list[str], method, temperature: float) -> tuple[int, dict]:
        """The index of the chosen continuation and what it was chosen from (scores, logprobs)."""
        raise NotImplementedError

    def commit_prefix(self, text: str) -> None:
        """Make `text` cached before several branches that start with it run (fork)."""

    def flush_cache(self) -> bool:
        raise LangError(f"{type(self).__name__} cannot flush a server's cache (it has no such call)")

    def get_server_info(self) -> dict:
        raise LangError(f"{type(self).__name__} cannot report server info (it has no such call)")

    def shutdown(self) -> None:
        pass
