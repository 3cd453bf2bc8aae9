"""Running one `gen` on a backend: plain, streamed, with `n` samples, or cut at a `stop_regex`.

`stop_regex` is applied here rather than by the server, so it works on every backend: the generation is streamed
and closed at the first match (the backend then ends the request), and the text keeps what came before the match,
as a stop string is cut off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from radixlm.lang.backend.base import Backend, Call, LangError


def compile_stop_regex(stop_regex) -> list[re.Pattern]:
    patterns = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex or [])
    try:
        return [re.compile(p) for p in patterns if p]
    except (re.error, TypeError) as e:
        raise LangError(f"gen(stop_regex={stop_regex!r}) is not a valid regular expression: {e}") from None


def first_match(text: str, patterns: list[re.Pattern]) -> re.Match | None:
    found = [m for m in (p.search(text) for p in patterns) if m is not None]
    return min(found, key=lambda m: m.start()) if found else None


def run_gen(backend: Backend, call: Call, stream: bool, emit: Callable[[str], None]) -> tuple[object, object]:
    """Generate for `call`, passing the text that joins the program to `emit` (piece by piece when `stream`).
    Returns the variable's value and meta info: a string and a dict, or with n > 1 a list of each (the first
    sample is the one that joins the text, as in SGLang)."""
    params = dict(call.params)
    patterns = compile_stop_regex(params.pop("stop_regex", None))
    call = replace(call, params=params)
    if (params.get("n") or 1) > 1:
        res = backend.generate(call)
        samples = res.samples or [res]
        texts = [_cut(s.text, patterns)[0] for s in samples]
        emit(texts[0])
        return texts, [s.meta for s in samples]
    if patterns:
        return _until_regex(backend, call, patterns, emit)
    if not stream:
        res = backend.generate(call)
        emit(res.text)
        return res.text, res.meta
    pieces, result = [], None
    for piece, res in backend.stream(call):
        if piece:
            pieces.append(piece)
            emit(piece)
        result = res or result
    return "".join(pieces), (result.meta if result else {})


def _cut(text: str, patterns: list[re.Pattern]) -> tuple[str, re.Match | None]:
    m = first_match(text, patterns)
    return (text if m is None else text[: m.start()]), m


def _until_regex(backend: Backend, call: Call, patterns: list[re.Pattern], emit) -> tuple[str, dict]:
    text, result, match = "", None, None
    pieces = iter(backend.stream(call))
    try:
        for piece, res in pieces:
            result = res or result
            if piece:
                text += piece
                match = first_match(text, patterns)
                if match is not None:
                    break
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()  # ends the request on the backend when the match came first
    if match is None:
        emit(text)
        return text, (result.meta if result else {})
    value = text[: match.start()]
    emit(value)
    return value, {"finish_reason": {"type": "stop", "matched": match.group(0)}}
