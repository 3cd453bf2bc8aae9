"""`--grammar-backend auto` moves a JSON schema asked for again from llguidance to outlines once outlines has
built its index in the background (srt/constrained/manager.py, AutoBackend.promotion), with the real backends
and the embedded model's tokenizer:

- the first requests are served at once by llguidance; a later one gets outlines' grammar, counted in
  stats.promotions, and a matcher from either accepts the same answer;
- schemas outlines does not enforce, or whose index could be huge, stay on llguidance for good;
- `--disable-grammar-promotion` (promote=False) keeps every request where auto first put it;
- (test_limits_and_metrics.py: a whole server answers a repeated schema validly before and after the move, and
  reports it in /metrics.)"""

from __future__ import annotations

import json
import time

import pytest

from radixlm.srt.constrained.base import GrammarSpec
from radixlm.srt.constrained.llguidance_backend import LLGuidanceCompiled
from radixlm.srt.constrained.manager import AutoBackend, GrammarManager
from radixlm.srt.constrained.outlines_backend import OutlinesCompiled
from tests.helpers import smollm_tokenizer

RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))  # properties in the order written, as the edge keeps them


@pytest.fixture(scope="module")
def tok():
    return smollm_tokenizer()


@pytest.fixture
def manager(tok):
    m = GrammarManager(AutoBackend(tok, len(tok), [2]), timeout=60)
    yield m
    m.shutdown()


def _compiled(manager: GrammarManager, spec: GrammarSpec):
    ticket = manager.request(spec)
    deadline = time.monotonic() + 60
    while (got := ticket.poll()) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not isinstance(got, Exception), got
    return got


def _settle(manager: GrammarManager, spec: GrammarSpec, timeout: float = 120.0):
    """Ask for `spec` until a request's grammar is outlines' (or the time is up); the last grammar served."""
    deadline = time.monotonic() + timeout
    while True:
        got = _compiled(manager, spec)
        if isinstance(got, OutlinesCompiled) or time.monotonic() > deadline:
            return got
        if manager._promoting is None and spec in manager._settled and spec not in manager._promoted:
            return _compiled(manager, spec)  # nothing under way: this is where it stays
        time.sleep(0.05)


def _accepts(compiled, tok, text: str) -> bool:
    m = compiled.matcher()
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and (m.is_terminated() or m.accept(2))


def test_a_repeated_schema_moves_to_outlines_and_keeps_its_language(manager, tok):
    spec = _spec(RECORD)
    first = _compiled(manager, spec)
    assert isinstance(first, LLGuidanceCompiled)  # a new schema is served at once, by llguidance
    assert manager.stats.promotions == 0
    later = _settle(manager, spec)
    assert isinstance(later, OutlinesCompiled), "the repeated schema never moved to outlines"
    assert manager.stats.promotions == 1
    assert manager.stats.compiles == 1  # the background build is not a cache miss
    for text, valid in [
        ('{"name": "Ann", "age": 3}', True),
        ('{"name": "a name too long here", "age": 3}', False),
        ('{"name": "Ann", "age": 3, "x": 1}', False),
        ('{"name": "Ann"}', False),
    ]:
        assert _accepts(first, tok, text) == valid == _accepts(later, tok, text), text
    assert isinstance(_compiled(manager, spec), OutlinesCompiled)  # and it stays there
    assert manager.stats.promotions == 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}}, "required": ["price"]},
        {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4096}}, "required": ["text"]},
    ],
    ids=["outlines_refuses_minimum", "index_too_large"],
)
def test_schemas_outlines_should_not_take_stay_on_llguidance(manager, schema):
    spec = _spec(schema)
    assert manager.backend.promotion(spec) is None
    for _ in range(3):
        assert isinstance(_compiled(manager, spec), LLGuidanceCompiled)
    assert manager.stats.promotions == 0 and manager._promoting is None


def test_promotion_can_be_turned_off(tok):
    manager = GrammarManager(AutoBackend(tok, len(tok), [2]), timeout=60, promote=False)
    try:
        spec = _spec(RECORD)
        for _ in range(3):
            assert isinstance(_compiled(manager, spec), LLGuidanceCompiled)
        assert manager._promoting is None and not manager._promoted
        assert manager.stats.promotions == 0
    finally:
        manager.shutdown()


def test_a_burst_of_one_new_schema_is_promoted_without_a_later_request(manager):
    """Requests that arrive together (a client's first 64) all join the first compile; the move starts when it
    ends, so the burst after it is served by outlines."""
    spec = _spec({**RECORD, "properties": {**RECORD["properties"], "burst": {"type": "boolean"}}})
    tickets = [manager.request(spec) for _ in range(8)]
    deadline = time.monotonic() + 120
    while spec not in manager._promoted:  # no further request: the move runs on its own
        assert time.monotonic() < deadline, "the burst's schema was never moved"
        time.sleep(0.02)
    assert all(isinstance(t.poll(), LLGuidanceCompiled) for t in tickets)
    assert isinstance(_compiled(manager, spec), OutlinesCompiled)
    assert manager.stats.promotions == 1
