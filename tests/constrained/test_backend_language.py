"""The llguidance and outlines backends enforce one language for a JSON schema both accept: `auto` may move a
repeated schema from llguidance (compiled in a millisecond) to outlines (a precomputed index, cheaper masks once
built), and an answer valid before the move must stay valid after it, and the other way round.

Each probe is a whole text, fed token by token to a fresh matcher of each backend and then offered the stop
token (or found already stopped): both must agree on whether the text is a complete answer. The probes hit the
corners where the two backends' scalars used to differ (string escapes, U+0080-U+009F, exponents) and the
separators."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.constrained.base import GrammarSpec
from radixlm.srt.constrained.manager import create_backend
from tests.helpers import smollm_tokenizer

STOP = 2

SCHEMAS = {
    "string": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]},
    "number": {"type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]},
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age"],
    },
}

PROBES = {
    "string": [
        '{"s": "plain"}',
        '{"s": "quote \\" and backslash \\\\"}',
        '{"s": "line\\nbreak\\ttab\\r\\b\\f"}',
        '{"s": "a\\/b"}',  # an escape JSON allows; neither backend writes it
        '{"s": "\\u00e9"}',
        '{"s": "C1 control \u0085 here"}',  # U+0085: JSON allows it raw
        '{"s": "del \u007f"}',
        '{"s": "caf\u00e9 \u4e2d\u6587"}',
        '{"s":"compact"}',
        '{"s" : "spaced"}',
        '{"s": "unterminated}',
    ],
    "number": [
        '{"n": 1}',
        '{"n": -0.5}',
        '{"n": 1e5}',
        '{"n": 1E+5}',
        '{"n": -1.5e-3}',
        '{"n": 01}',
        '{"n": 1.}',
        '{"n": .5}',
        '{"n": 12345678901234567890}',
    ],
    "record": [
        '{"name": "Ann", "age": 3}',
        '{"name": "Ann", "age": 3, "tags": ["a", "b"]}',
        '{"name": "Ann", "age": 3, "tags": []}',
        '{"name": "Ann","age": 3}',
        '{"name": "Ann", "age": 3, "tags": ["a","b"]}',
        '{"name": "Ann", "age": 3.5}',
        '{"name": "exactly12chr", "age": 1}',
        '{"name": "thirteen char", "age": 1}',
        '{"age": 3, "name": "Ann"}',
        '{"name": "Ann"}',
    ],
}


@pytest.fixture(scope="module")
def backends():
    tok = smollm_tokenizer()
    return tok, {name: create_backend(name, tok, len(tok), [STOP]) for name in ("llguidance", "outlines")}


def _complete(backend, tok, schema: dict, text: str) -> bool:
    m = backend.compile(GrammarSpec("json_schema", json.dumps(schema))).matcher()
    if not all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)):
        return False
    return m.is_terminated() or m.accept(STOP)  # llguidance stops by itself where nothing else may follow


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_llguidance_and_outlines_accept_the_same_answers(backends, kind):
    tok, by_name = backends
    verdicts = {
        text: {name: _complete(b, tok, SCHEMAS[kind], text) for name, b in by_name.items()} for text in PROBES[kind]
    }
    differ = {text: v for text, v in verdicts.items() if len(set(v.values())) > 1}
    assert not differ, differ
    # the probes are not all of one verdict: both backends do refuse the broken ones and take the valid ones
    assert {v["llguidance"] for v in verdicts.values()} == {True, False}
