"""What users send, checked where requests enter: a grammar's sampling parameters into one GrammarSpec, with
a 400 naming the problem for anything a backend cannot express (instead of a crash or a silently
unconstrained answer)."""

from __future__ import annotations

import functools
import json
import re

# Imported at module level: a machine without jsonschema fails at start-up, not per schema request.
from jsonschema import Draft202012Validator, SchemaError

from radixlm.srt.constrained.base import GrammarSpec
from radixlm.srt.errors import GrammarError

MAX_SPEC_CHARS = 200_000
# Objects and arrays inside one schema document. Real schemas nest a dozen levels; past this, JSON encoders
# hit Python's recursion limit and outlines-core's parser gives up with an unrelated message.
MAX_SCHEMA_DEPTH = 64


def json_depth(value) -> int:
    """Nesting depth of objects/arrays, without recursion (the input may be nested arbitrarily deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((x, d + 1) for x in v)
    return deepest


_LOOKAROUND = re.compile(r"\(\?<?[=!]|\\[1-9]")


def parse_json_schema(value) -> str:
    """A schema given as an object or as JSON text, as compact JSON text (key order kept: it is the order the
    fields are generated in). Results are cached by the schema's text: the meta-schema check of a large schema
    takes tenths of a second, and a request's grammar is read several times on its way in (and most clients send
    the same few schemas again and again)."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            pass  # not JSON-able, or too deep: refused below with the reason
        else:
            return _parse_schema_text(value)
        return _parse_schema(value)
    return _parse_schema_text(value)


@functools.lru_cache(maxsize=256)
def _parse_schema_text(text: str) -> str:
    return _parse_schema(text)


def _parse_schema(value) -> str:
    too_deep = False
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", param="json_schema") from None
        except RecursionError:
            too_deep = True
    if too_deep or json_depth(value) > MAX_SCHEMA_DEPTH:
        raise GrammarError(
            f"json_schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels", param="json_schema"
        )
    if not isinstance(value, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object (a schema)", param="json_schema")
    if isinstance(value, dict):
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as e:
            raise GrammarError(
                f"json_schema is not a valid JSON schema: at {e.json_path}: {e.message}", param="json_schema"
            ) from None
    if isinstance(value, dict):
        from radixlm.srt.constrained.schema_support import drop_unknown_formats

        value = drop_unknown_formats(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def grammar_spec(json_schema=None, regex=None, ebnf=None, tool_call=None) -> GrammarSpec | None:
    given = [
        (k, v)
        for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf), ("tool_call", tool_call))
        if v is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(
            f"give at most one of json_schema, regex, ebnf and tools (got {', '.join(k for k, _ in given)})",
            param=given[1][0],
        )
    kind, value = given[0]
    if kind == "json_schema":
        text = parse_json_schema(value)
    else:
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{kind} must be a non-empty string", param=kind)
        text = value
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(f"{kind} is longer than {MAX_SPEC_CHARS} characters", param=kind)
    if kind == "regex":
        check_regex(text)
    return GrammarSpec(kind, text)


def check_regex(regex: str) -> None:
    if _LOOKAROUND.search(regex):
        raise GrammarError(
            "regex: lookaround assertions and backreferences are not supported (grammar engines "
            "match with finite automata)",
            param="regex",
        )
    try:
        re.compile(regex)
    except re.error as e:
        raise GrammarError(f"regex is not a valid regular expression: {e}", param="regex") from None


# `--grammar-backend auto` tries them in this order and takes the first that can enforce the whole spec:
# llguidance refuses what it does not implement and compiles in about a millisecond; xgrammar has the fastest
# masks but drops some keywords (schema_support lists them) and compiles in tenths of a second; outlines-core
# builds a whole DFA, which can take seconds to minutes.
AUTO_ORDER = ("llguidance", "xgrammar", "outlines")
BACKENDS = ("auto", *AUTO_ORDER, "none")


@functools.lru_cache(maxsize=1024)
def _refusal(spec: GrammarSpec, backend: str) -> str | None:
    """Why `backend` cannot enforce `spec` (a sentence naming the keyword where there is one), or None."""
    if spec.kind == "ebnf" and backend == "outlines":
        return "EBNF grammars are not supported by the outlines grammar backend"
    if backend == "llguidance":
        from radixlm.srt.constrained.llguidance_backend import check, one_line

        why = check(spec)
        return None if why is None else f"llguidance: {one_line(why)}"
    if spec.kind in ("json_schema", "tool_call"):
        from radixlm.srt.constrained.schema_support import unsupported_keyword

        schema = json.loads(spec.spec)
        if spec.kind == "tool_call":
            schema = schema["schema"]
        found = unsupported_keyword(schema, backend)
        if found:
            path, keyword, why = found
            return f"{keyword!r} at {path} is not supported by the {backend} grammar backend ({why})"
    return None


def enforces(spec: GrammarSpec, backend: str) -> bool:
    """Whether `backend` (not auto) enforces every keyword of `spec`."""
    return _refusal(spec, backend) is None


def check_supported(spec: GrammarSpec, backend: str) -> str:
    """The backend that will enforce `spec` (for `auto`, the first of AUTO_ORDER that can); a GrammarError (400)
    naming what is not supported when none can."""
    name = "tools" if spec.kind == "tool_call" else spec.kind
    if backend == "none":
        raise GrammarError("structured output is disabled on this server (--grammar-backend none)", param=name)
    if backend != "auto":
        why = _refusal(spec, backend)
        if why is not None:
            hint = "; start the server with --grammar-backend auto" if backend != "llguidance" else ""
            raise GrammarError(f"{name}: {why}{hint}", param=name)
        return backend
    reasons = []
    for candidate in AUTO_ORDER:
        why = _refusal(spec, candidate)
        if why is None:
            return candidate
        reasons.append(why)
    raise GrammarError(
        f"{name}: no grammar backend can enforce this {spec.describe()}: " + "; ".join(reasons), param=name
    )
