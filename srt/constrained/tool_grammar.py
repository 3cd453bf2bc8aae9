"""The grammar of a tool-calling answer, in the Hermes/Qwen format most chat templates use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`call` mode (tool_choice required or a named function): the answer is one such block. `auto` mode: the
answer is free text that does not start with the opening tag, or tool calls; once the tag begins, the call is
constrained. Spec (JSON text): {"mode": "call" | "auto", "schema": <one call's JSON schema>}."""

from __future__ import annotations

import json

BEGIN, END = "<tool_call>\n", "\n</tool_call>"
_SPECIAL = set(".^$*+?()[]{}|\\")


def regex_escape(text: str) -> str:
    """Escape for both Rust's regex (outlines-core) and xgrammar's regex (Python's re.escape writes a
    backslash before a raw newline, which they reject)."""
    out = []
    for c in text:
        if c == "\n":
            out.append(r"\n")
        elif c == "\t":
            out.append(r"\t")
        elif c in _SPECIAL:
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


def not_prefixed_regex(prefix: str) -> str:
    """Any text that does not start with `prefix` (proper prefixes of it included)."""
    # stopping inside the tag: the empty text is written as an optional group, because an empty alternative
    # `()` makes outlines-core allow nothing but EOS at the start
    alts = [regex_escape(prefix[:k]) for k in range(1, len(prefix))]
    for k in range(len(prefix)):
        c = prefix[k]
        excl = r"\n" if c == "\n" else ("\\" + c if c in _SPECIAL else c)
        alts.append(f"{regex_escape(prefix[:k])}[^{excl}][\\s\\S]*")
    return "(" + "|".join(f"({a})" for a in alts) + ")?"


def parse_spec(spec: str) -> tuple[str, dict]:
    d = json.loads(spec)
    return d["mode"], d["schema"]


def calls_regex(json_regex: str) -> str:
    """One call per answer (parallel calls are not generated: the xgrammar backend could not bound them)."""
    return f"{regex_escape(BEGIN)}({json_regex}){regex_escape(END)}"


def tool_call_regex(spec: str, json_regex: str) -> str:
    mode, _ = parse_spec(spec)
    calls = calls_regex(json_regex)
    return calls if mode == "call" else f"({not_prefixed_regex(BEGIN)})|({calls})"
