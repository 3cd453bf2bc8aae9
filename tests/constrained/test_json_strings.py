"""JSON from every grammar backend is JSON: inside a string, no backend allows a token holding a raw control
character (U+0000-U+001F must be escaped there; `json.loads` rejects them raw).

Checked on the masks themselves, so it does not depend on what a model happens to sample: for each kind of string
a schema can declare (plain, length-bounded, patterned, formatted, an object key), the grammar is walked to just
inside the string and every allowed token's bytes are read."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.constrained.base import GrammarSpec
from radixlm.srt.constrained.bitmask import allocate, allowed_ids
from radixlm.srt.constrained.manager import create_backend
from radixlm.srt.constrained.vocab import token_bytes
from tests.helpers import GRAMMAR_BACKENDS, smollm_tokenizer

STRINGS = {
    "plain": {"type": "string"},
    "max_length": {"type": "string", "maxLength": 6},
    "min_length": {"type": "string", "minLength": 2},
    "min_max_length": {"type": "string", "minLength": 1, "maxLength": 40},
    "pattern_dot": {"type": "string", "pattern": "^.{1,8}$"},
    "pattern_negated_class": {"type": "string", "pattern": "^[^a]*$"},
    "email": {"type": "string", "format": "email"},
    "uri": {"type": "string", "format": "uri"},
    "date_time": {"type": "string", "format": "date-time"},
    "enum_or_free": {"anyOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "string", "maxLength": 9}]},
}


@pytest.fixture(scope="module")
def vocab():
    tok = smollm_tokenizer()
    by_id = token_bytes(tok).by_id
    control = {i for i, b in by_id.items() if any(x < 0x20 for x in b)}
    assert len(control) > 50  # the vocabulary does hold such tokens (the probe could otherwise pass vacuously)
    return tok, len(tok), control


def _inside(backend, tok, schema: dict, prefix: str):
    m = backend.compile(GrammarSpec("json_schema", json.dumps(schema))).matcher()
    for t in tok.encode(prefix, add_special_tokens=False):
        assert m.accept(t), prefix
    return m


@pytest.mark.parametrize("name", GRAMMAR_BACKENDS)
def test_no_backend_allows_raw_control_characters_in_strings(vocab, name):
    tok, size, control = vocab
    backend = create_backend(name, tok, size, [2])
    mask = allocate(1, size, pin=False)
    cases = {k: ({"type": "object", "properties": {"v": s}, "required": ["v"]}, '{"v": "') for k, s in STRINGS.items()}
    cases["object_key"] = ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"')
    leaks = {}
    for kind, (schema, prefix) in cases.items():
        m = _inside(backend, tok, schema, prefix)
        m.fill_mask(mask, 0)
        allowed = set(allowed_ids(mask, 0, size))
        assert allowed - {2}, kind  # inside a string, something other than the end is allowed
        bad = allowed & control
        if bad:
            leaks[kind] = sorted(tok.decode([t]) for t in list(bad)[:5])
    assert not leaks, f"{name} allows raw control characters inside JSON strings: {leaks}"


def test_outlines_writes_json_as_the_other_backends_do():
    """outlines-core allows an optional space around every separator; our outlines backend holds it to the
    separators llguidance and xgrammar write (`{"a": 1, "b": [1, 2]}`), so a request answers alike on every
    backend."""
    import re

    from radixlm.srt.constrained.outlines_backend import json_regex

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"],
    }
    regex = re.compile(json_regex(json.dumps(schema)))
    assert regex.fullmatch('{"a": 1, "b": [1, 2]}') and regex.fullmatch('{"a": -3, "b": []}')
    spaced = ['{ "a": 1, "b": [1, 2]}', '{"a" : 1, "b": [1, 2]}', '{"a":1, "b": [1, 2]}', '{"a": 1 , "b": []}']
    spaced += ['{"a": 1,"b": []}', '{"a": 1, "b": [1,2]}', '{"a": 1, "b": [ 1, 2 ]}', '{"a": 1, "b": []} ']
    for text in spaced:
        assert not regex.fullmatch(text), text
    optional = {"type": "object", "properties": {"a": {"type": "integer"}, "z": {"type": "integer"}}, "required": ["z"]}
    optional["properties"] = {"x": {"type": "integer"}, **optional["properties"]}
    optional["required"] = ["x", "z"]
    opt = re.compile(json_regex(json.dumps(optional)))  # "a" optional, between two required properties
    assert opt.fullmatch('{"x": 1, "a": 2, "z": 3}') and opt.fullmatch('{"x": 1, "z": 3}')
    assert not opt.fullmatch('{"x": 1,"z": 3}') and not opt.fullmatch('{"x": 1, "a": 2,"z": 3}')
    free = re.compile(json_regex(json.dumps({"type": "object", "additionalProperties": {"type": "integer"}})))
    assert free.fullmatch('{"x": 1, "y": 2}') and not free.fullmatch('{"x":1,"y":2}')
