"""Grammar-constrained decoding under overlap scheduling (the CUDA default, forced here on the CPU): jump-forward is
opt-in there, and the next batch's mask filled early on the mask thread gives the answers overlap off gives."""

import json
import re

import jsonschema
import pytest

import radixlm
from tests.constrained.test_grammar_scheduler import (
    GREEDY,
    JF_MAX_NEW_TOKENS,
    JF_PROMPTS,
    JF_SCHEMA,
    SMALL_SCHEMA,
    _assert_grammar_stop,
    _grammar_stats,
)
from tests.helpers import assert_engine_idle


def test_jump_forward_under_overlap_is_opt_in():
    """Overlap scheduling (the default on CUDA; forced here on the CPU) runs without jump-forward unless
    --jump-forward on asks for it; asked for, it jumps there too and the JSON still validates."""
    sp = {"json_schema": JF_SCHEMA, **GREEDY, "max_new_tokens": JF_MAX_NEW_TOKENS}
    events = {}
    for name, kw in (("default", {}), ("enabled", {"jump_forward": "on"})):
        engine = radixlm.Engine(force_overlap_schedule=True, log_level="warning", max_total_tokens=4096, **kw)
        try:
            assert engine.scheduler.overlap and engine.scheduler.grammar.jump_forward == bool(kw)
            for out in engine.generate(JF_PROMPTS, sp):
                _assert_grammar_stop(engine, out)
                jsonschema.validate(json.loads(out["text"]), JF_SCHEMA)
            events[name] = _grammar_stats(engine)["jump_forward_events"]
            assert_engine_idle(engine)
        finally:
            engine.shutdown()
    assert events["default"] == 0 and events["enabled"] > 0, events


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_overlap_fills_masks_early_and_answers_as_without_overlap(backend):
    """Under overlap scheduling (the CUDA default) a constrained batch's mask is filled on the mask thread while
    the previous step is processed. Greedy and seeded sampled answers of a mixed batch (JSON, regex,
    unconstrained, penalties: these sample after the step before is processed) are the same as with overlap off,
    every constrained one valid, and the early fill really ran."""
    prompts = [
        "Describe a pet owner in JSON: ",
        "My favourite pet is a ",
        "The capital of France is",
        "Another pet owner, as JSON: ",
        "A third pet owner, as JSON: ",
        "Name some animals:",
    ]
    sampled = {"temperature": 1.0, "top_p": 0.95}  # seeded: the same tokens whichever step samples them
    params = [
        {"json_schema": SMALL_SCHEMA, **GREEDY, "max_new_tokens": 40},
        {"regex": r"(cat|dog|bird)", **GREEDY, "max_new_tokens": 8},
        {**GREEDY, "max_new_tokens": 8},
        {"json_schema": SMALL_SCHEMA, **GREEDY, "max_new_tokens": 40},
        {"json_schema": SMALL_SCHEMA, **sampled, "seed": 7, "max_new_tokens": 40},
        {**sampled, "seed": 3, "presence_penalty": 0.5, "max_new_tokens": 12},  # penalties sample late too
    ]
    outs = {}
    for overlap in (False, True):
        engine = radixlm.Engine(
            grammar_backend=backend,
            force_overlap_schedule=overlap,
            log_level="warning",
            max_total_tokens=4096,
            disable_overlap_schedule=not overlap,
            jump_forward="off",
        )
        try:
            assert engine.scheduler.overlap == overlap and not engine.scheduler.grammar.jump_forward
            outs[overlap] = [o["text"] for o in engine.generate(prompts, params)]
            assert (engine.scheduler.grammar._filler is not None) == overlap
            assert_engine_idle(engine)
        finally:
            engine.shutdown()
    assert outs[True] == outs[False]
    for i in (0, 3, 4):
        jsonschema.validate(json.loads(outs[True][i]), SMALL_SCHEMA)
    assert re.fullmatch(r"(cat|dog|bird)", outs[True][1])
