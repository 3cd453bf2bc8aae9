"""What users send, checked where requests enter: a grammar's sampling parameters into one GrammarSpec, with
a 400 naming the problem for anything a backend cannot express (instead of a crash or a silently
unconstrained answer)."""
from __future__ import annotations

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
    fields are generated in)."""
    too_deep = False
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}", param="json_schema") from None
        except RecursionError:
            too_deep = True
    if too_deep or json_depth(value) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"json_schema nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels",
                           param="json_schema")
    if not isinstance(value, (dict, bool)):
        raise GrammarError("json_schema must be a JSON object (a schema)", param="json_schema")
    if isinstance(value, dict):
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as e:
            raise GrammarError(f"json_schema is not a valid JSON schema: at {e.json_path}: {e.message}",
                               param="json_schema") from None
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def grammar_spec(json_schema=None, regex=None, ebnf=None, tool_call=None) -> GrammarSpec | None:
    given = [(k, v) for k, v in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf),
                                 ("tool_call", tool_call)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError("give at most one of json_schema, regex, ebnf and tools "
                           f"(got {', '.join(k for k, _ in given)})", param=given[1][0])
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
        raise GrammarError("regex: lookaround assertions and backreferences are not supported (grammar engines "
                           "match with finite automata)", param="regex")
    try:
        re.compile(regex)
    except re.error as e:
        raise GrammarError(f"regex is not a valid regular expression: {e}", param="regex") from None


def check_supported(spec: GrammarSpec, backend: str) -> None:
    """Reject at the edge what `backend` cannot express or would not enforce."""
    if backend == "none":
        raise GrammarError("structured output is disabled on this server (--grammar-backend none)",
                           param=spec.kind)
    if spec.kind == "ebnf" and backend == "outlines":
        raise GrammarError("EBNF grammars are not supported by the outlines grammar backend; start the server "
                           "with --grammar-backend xgrammar", param="ebnf")
    if spec.kind in ("json_schema", "tool_call"):
        from radixlm.srt.constrained.schema_support import unsupported_keyword

        schema = json.loads(spec.spec)
        name = "json_schema"
        if spec.kind == "tool_call":
            schema, name = schema["schema"], "tools"
        found = unsupported_keyword(schema, backend)
        if found:
            path, keyword, why = found
            raise GrammarError(f"{name}: {keyword!r} at {path} is not supported by the {backend} grammar "
                               f"backend ({why})", param=name)
