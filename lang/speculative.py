"""API speculative execution, `@function(num_api_spec_tokens=N)`: fewer requests for programs that interleave
short gens with fixed text (SGLang's feature, for APIs that bill or wait per request).

On an API that takes text (every backend but a chat-only one): a gen asks for at least N tokens with no stop
strings and keeps what comes before its own stop; the rest is held as speculation. Text the program appends next
is checked against it: where the model already wrote that text, it is consumed and the next gen starts from what
follows with no request of its own. A mismatch drops the speculation.

On a chat-only API: an assistant turn is one request. Its fixed text and gens are recorded while the turn is
built; when it ends, one answer of up to N tokens is asked for and split along the recorded pattern (the fixed
text must appear in order, a gen ends at its first stop string, else where the next fixed text begins). An answer
that does not fit is asked for again (when sampling); after that the turn runs piece by piece, as without
speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from radixlm.lang.backend.base import Backend, Call, GenResult

_MAX_TRIES = 3
# a gen with any of these is not speculated: its text must come from its own constrained or scored request
_OWN_REQUEST = ("regex", "json_schema", "stop_regex", "return_logprob")


def speculable(params: dict) -> bool:
    return not any(params.get(k) for k in _OWN_REQUEST) and (params.get("n") or 1) == 1


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]


def _earliest(text: str, needles: list[str]) -> int | None:
    found = [i for i in (text.find(n) for n in needles) if i >= 0]
    return min(found) if found else None


def _ask(params: dict, num_tokens: int) -> dict:
    """The speculative request: the gen's sampling settings, no stop strings, at least `num_tokens` tokens."""
    ask = {k: v for k, v in params.items() if k != "stop"}
    ask["max_new_tokens"] = max(ask.get("max_new_tokens") or 0, num_tokens)
    return ask


@dataclass
class CompletionSpeculation:
    num_tokens: int
    buffer: str = ""  # what the model wrote past the text so far, not yet used

    def observe(self, text: str) -> None:
        """`text` joined the program by other means (fixed text, a select): where the model wrote it too, the
        speculation goes on after it."""
        if text:
            self.buffer = self.buffer[len(text) :] if self.buffer.startswith(text) else ""

    def reset(self) -> None:
        self.buffer = ""

    def gen(self, backend: Backend, call: Call) -> tuple[str, dict]:
        meta: dict = {"speculative": True}
        if not self.buffer:
            res = backend.generate(replace(call, params=_ask(call.params, self.num_tokens)))
            self.buffer, meta = res.text, {**res.meta, "speculative": True}
        cut = _earliest(self.buffer, _stops(call.params.get("stop")))
        if cut is None:
            value, self.buffer = self.buffer, ""
        else:  # the stop string stays: the program's next fixed text usually starts with it
            value, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return value, meta


@dataclass
class Term:
    text: str | None = None  # fixed text, or
    gen: object = None  # a Gen or Select recorded as it came (replayed when the answer does not fit)
    params: dict | None = None  # a speculable gen's merged parameters


@dataclass
class ChatTurnSpeculation:
    num_tokens: int
    terms: list[Term] = field(default_factory=list)

    def pending(self, name: str) -> bool:
        return any(getattr(t.gen, "name", None) == name for t in self.terms)

    def resolve(self, backend: Backend, call: Call) -> tuple[list[str], GenResult] | None:
        """Each term's text from one answer to `call` (the turn's start), or None when the turn must run piece by
        piece: it holds something that needs its own request, or no answer fit its pattern."""
        gens = [t for t in self.terms if t.text is None]
        if not gens or any(t.params is None for t in gens):
            return None
        params = _ask(gens[0].params, self.num_tokens)
        tries = 1 if params.get("temperature") == 0 else _MAX_TRIES  # greedy answers the same every time
        for _ in range(tries):
            res = backend.generate(replace(call, params=params))
            parts = split_turn(res.text, self.terms)
            if parts is not None:
                return parts, res
        return None


def split_turn(answer: str, terms: list[Term]) -> list[str] | None:
    """The text of every term, read from one answer, or None if the answer does not follow the pattern."""
    out, pos = [], 0
    for i, term in enumerate(terms):
        if term.text is not None:
            if not answer.startswith(term.text, pos):
                return None
            out.append(term.text)
            pos += len(term.text)
            continue
        rest = answer[pos:]
        nxt = next((t.text for t in terms[i + 1 :] if t.text is not None), None)
        end = _earliest(rest, _stops(term.params.get("stop")))
        if end is None and nxt:
            end = _earliest(rest, [nxt])
        if end is None:
            if any(t.text is None for t in terms[i + 1 :]) or nxt:
                return None  # later gens or fixed text have nothing left to come from
            end = len(rest)
        out.append(rest[:end])
        pos += end
    return out
