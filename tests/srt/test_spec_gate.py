"""The speculative gate (srt/speculative/gate.py): drafting only at batch sizes where stretches of steps with
drafting delivered more tokens per second than stretches without, and only drafts whose expected accepted
tokens pay for their verify step; unit tests on synthetic step timings, then the scheduler dropping drafts
that do not pay on the embedded model."""

from __future__ import annotations

import pytest

import radixlm
from radixlm.srt.speculative import gate as g
from radixlm.srt.speculative.drafter import Drafter, SpecConfig, expected
from tests.helpers import assert_engine_idle


def _steps(gate, n, plain, spec, count):
    """`count` steps of n requests at `plain` tokens/s while the gate is closed, `spec` while it is open."""
    for _ in range(count):
        is_open = gate.allows(n)
        gate.observe(is_open, n, n, n / (spec if is_open else plain))


def _until_open(gate, n, plain):
    start = gate.step
    while not gate.allows(n):
        _steps(gate, n, plain, 0.0, 1)
    return gate.step - start


def test_gate_closes_a_batch_size_where_drafting_loses_and_probes_it_again():
    gate = g.SpecGate()
    assert not gate.allows(8)  # a batch size never seen decodes plainly first: the figure drafting must beat
    assert _until_open(gate, 8, 1000.0) == g.MEASURE_STEPS and gate.plain_rate(gate.bucket(8)) == pytest.approx(1000.0)
    _steps(gate, 8, 1000.0, 600.0, g.JUDGE_STEPS)  # a first stretch is not judged on a few steps (the first
    assert gate.allows(8) and gate.closures == 0  # step after the switch does not count: JUDGE_STEPS - 1 so far)
    _steps(gate, 8, 1000.0, 600.0, 1)  # at JUDGE_STEPS: drafting delivered fewer tokens/s, closed
    assert not gate.allows(8) and not gate.allows(12) and gate.closures == 1
    # larger batches gain less: they close as long; smaller ones keep their own record (none yet)
    assert not gate.allows(16) and not gate.allows(200)
    assert gate.bucket(4) not in gate.closed_until and gate.bucket(1) not in gate.closed_until
    first = int(g.FIRST_PAUSE * (1000.0 / 600.0) ** 2)  # the first pause grows with the loss
    pauses = []
    for _ in range(7):
        pauses.append(_until_open(gate, 8, 1000.0))
        _steps(gate, 8, 1000.0, 600.0, 1 + g.PROBE_STEPS)  # the probe (short: this bucket lost before) loses again
        assert not gate.allows(8)
    assert pauses == [first, 2 * first, 4 * first, 8 * first, g.MAX_PAUSE, g.MAX_PAUSE, g.MAX_PAUSE], pauses
    assert gate.closures == 8
    # The text turned copyable: the next probe wins, and the bucket stays open.
    _until_open(gate, 8, 1000.0)
    _steps(gate, 8, 1000.0, 2500.0, 1 + 3 * g.JUDGE_STEPS)
    assert gate.allows(8) and gate.closures == 8


def test_gate_a_loss_leaves_larger_batch_sizes_that_won_open():
    gate = g.SpecGate()
    for n in (32, 8):
        _until_open(gate, n, 1000.0)
    _steps(gate, 32, 1000.0, 1500.0, 1 + g.JUDGE_STEPS)  # drafting wins at 32 (a copy-heavy batch)
    assert gate.allows(32) and gate.bucket(32) in gate.won
    _steps(gate, 8, 1000.0, 100.0, 1 + g.PROBE_STEPS)  # and loses badly at 8: judged early, on a short stretch
    assert not gate.allows(8) and gate.allows(32)
    assert gate.pause[gate.bucket(8)] == g.MAX_PAUSE  # a 10x loss: the longest pause at once
    assert not gate.allows(64)  # a larger size with no record of its own follows the loss


def test_gate_counts_only_steady_steps_and_remeasures_decoding_while_drafting_wins():
    gate = g.SpecGate()
    for _ in range(40):  # every step a switch of batch size or an extend: nothing counts, nothing closes
        gate.observe(True, 4, 4, 4 / 100.0)
        gate.observe(True, 8, 8, 8 / 100.0)
        gate.observe(None, 8, 0, 0.01)
    assert not any(s.steps for s in gate.opened.values()) and not gate.closed_until and gate.closures == 0
    _until_open(gate, 4, 1000.0)
    # Drafting wins and keeps the bucket open, until its decoding figure is due to be measured afresh.
    opened = gate.step
    while gate.allows(4):
        _steps(gate, 4, 1000.0, 3000.0, 1)
    assert g.REFRESH_EVERY - g.JUDGE_STEPS <= gate.step - opened <= g.REFRESH_EVERY + g.MEASURE_STEPS + g.JUDGE_STEPS
    assert gate.closures == 0 and gate.plain_rate(gate.bucket(4)) is None  # the old figure is not trusted


def test_a_verify_step_must_pay_for_itself():
    gate = g.SpecGate()
    assert gate.pays(8, 0.0)  # nothing measured yet: drafts go ahead, so that both figures get measured
    _until_open(gate, 8, 1000.0)  # decoding: 8 requests, 8 ms a step
    assert gate.pays(8, 0.0)  # no verify step measured yet
    gate.observe(True, 8, 8, 0.008)  # a decode step, then a verify step after it: its wait is the decode's
    gate.observe(True, 8, 20, 0.016, verify=True)
    assert g.SpecGate.bucket(8) not in gate.verify_seconds
    gate.observe(True, 8, 20, 0.016, verify=True)  # a verify step after a verify step: 16 ms, twice a decode step
    assert gate.verify_seconds[gate.bucket(8)] == pytest.approx(0.016)
    # at 1,000 tok/s a 16 ms verify step of 8 requests must give 16 tokens: 8 of them from the drafts
    assert gate.pays(8, 8.5) and not gate.pays(8, 7.5) and gate.unpaid == 1
    assert gate.pays(1, 0.0)  # batch 1 keeps its own figures (none yet)
    gate.observe(True, 8, 8, 0.032, verify=True)  # verify steps slow down: the running mean follows
    assert gate.verify_seconds[gate.bucket(8)] == pytest.approx(0.016 + g.VERIFY_WEIGHT * 0.016)
    assert not gate.pays(8, 8.5)


def test_expected_accepted_tokens_and_dropped_drafts():
    class R:
        def __init__(self, rate, drafted=0, accepted=0):
            self.spec_rate, self.spec_draft_tokens, self.spec_accepted_tokens = rate, drafted, accepted

    reqs = [R(1.0), R(0.5), R(0.0), R(0.9)]
    drafts = [[1, 2, 3], [4], [6], []]
    # k draft tokens a drafting request whatever this draft's length (a short draft after a miss grows back)
    assert expected(reqs, drafts, 3) == pytest.approx(3 + (0.5 + 0.25 + 0.125) + 0.0)
    # one bad draft halves the running rate of a request that copied well so far: its record counts
    assert expected([R(0.45, drafted=40, accepted=36)], [[1]], 2) == pytest.approx(0.9 + 0.81)

    class Never:
        def pays(self, n, e):
            return False

    drafter = Drafter(SpecConfig(3, 1, 3, None), None, 1024)
    assert drafter.paying(reqs, drafts, None) is drafts
    assert drafter.paying(reqs, [[], [], [], []], Never()) == [[], [], [], []]
    assert drafter.paying(reqs, drafts, Never()) == [[], [], [], []]
    # a dropped draft's request regains some of its acceptance, so that it drafts again some looks later
    assert [r.spec_rate for r in reqs] == pytest.approx([1.0, 0.55, 0.1, 0.9])


def test_drafts_that_do_not_pay_are_dropped_and_answers_stay_plain_decodings():
    """The gate open at batch 1 but with figures no draft can pay for (a verify step of a second, decoding at a
    billion tokens per second): the scheduler drops every draft, answers are plain decoding's, nothing leaks."""
    args = dict(log_level="warning", max_total_tokens=4096, dtype="float32", quantization="none")
    prompt = "Repeat after me three times: red apples, green pears, yellow bananas. red apples, green pears,"
    params = {"max_new_tokens": 24, "temperature": 0}
    plain = radixlm.Engine(**args, disable_overlap_schedule=True)
    try:
        want = plain.generate(prompt, params)["output_ids"]
    finally:
        plain.shutdown()
    e = radixlm.Engine(**args, speculative_algorithm="ngram", force_overlap_schedule=True)
    try:
        s = e.scheduler
        b = s.spec_gate.bucket(1)
        s.spec_gate.closed_until[b] = 0
        s.spec_gate.closed[b] = g.Stretch(tokens=10**9, seconds=1.0, steps=g.MEASURE_STEPS)
        s.spec_gate.verify_seconds[b] = 1.0
        s.spec_gate.refresh_at[b] = 10**9
        assert e.generate(prompt, params)["output_ids"] == want
        assert s.stats.spec_verify_steps == 0 and s.stats.spec_unpaid_steps >= 1
        assert s.stats.spec_unpaid_steps == s.spec_gate.unpaid
        assert_engine_idle(e)
    finally:
        e.shutdown()
