"""Aborts leave nothing behind, under the overlap scheduler (the CUDA default) as without it: scores of requests
aborted at every stage a client can hang up in (waiting, a grammar compiling, a long prompt half prefilled in
chunks, decoding, a token still in flight) and afterwards no request object is alive, every KV slot and request
row is free, and the scheduler's invariants hold."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

import radixlm
from tests.helpers import assert_engine_idle

SYSTEM = "You are a helpful assistant who answers questions about rivers and mountains. " * 6
ROUNDS = 12  # of 8 requests, 5 of them aborted: 60 aborts at random stages (the leak this guards was ~1.5 MB each)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


@pytest.mark.parametrize("overlap", [True, False])
def test_aborts_leave_no_request_alive(overlap):
    engine = radixlm.Engine(
        log_level="warning",
        max_total_tokens=8192,
        chunked_prefill_size=64,
        force_overlap_schedule=overlap,
        disable_overlap_schedule=not overlap,
    )
    assert engine.scheduler.overlap == overlap
    rng = random.Random(0)
    refs, aborted = [], 0
    try:
        for round_ in range(ROUNDS):
            params = [{"max_new_tokens": 12, "temperature": 0.8, "seed": rng.randrange(1000)} for _ in range(8)]
            params[0]["json_schema"] = SCHEMA  # one waits for its grammar first
            prompts = [SYSTEM + f"Question {round_}.{k}: name a river." for k in range(8)]
            prompts[1] = SYSTEM * 2 + "Name a mountain."  # several prefill chunks
            rids = engine.add_request(prompts, params)
            sch = engine.scheduler
            refs += [weakref.ref(r) for r in [*sch.waiting, *(r for r, _ in sch.grammar.queue)]]
            for _ in range(rng.randint(0, 6)):  # abort at a random stage
                engine.step()
            for rid in rng.sample(rids, 5):
                aborted += engine.abort(rid)
            while engine.has_unfinished_requests():
                engine.step()
        assert aborted >= ROUNDS * 4 and len(refs) == ROUNDS * 8
        assert_engine_idle(engine)
        gc.collect()
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"{len(alive)} requests still alive, e.g. {alive[0].rid} ({alive[0].finished_reason})"
    finally:
        engine.shutdown()
