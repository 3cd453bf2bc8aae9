"""The speculative gate (srt/speculative/gate.py): drafting only at batch sizes where stretches of steps with
drafting delivered more tokens per second than stretches without; unit tests on synthetic step timings (the
engine-level test of the gate's default is in test_speculative.py)."""

from __future__ import annotations

import pytest

from radixlm.srt.speculative import gate as g


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
    # the first pause: a probe losing as much (5 steps, each 8/600 - 8/1000 s beyond its tokens' worth) costs
    # PROBE_SHARE of the 8 ms decode steps between probes
    first = int((g.PROBE_STEPS + 1) * (8 / 600.0 - 8 / 1000.0) / (g.PROBE_SHARE * 8 / 1000.0))
    assert g.FIRST_PAUSE < first < g.MAX_PAUSE // 4
    pauses = []
    for _ in range(7):
        pauses.append(_until_open(gate, 8, 1000.0))
        _steps(gate, 8, 1000.0, 600.0, 1 + g.PROBE_STEPS)  # the probe (short: this bucket lost before) loses again
        assert not gate.allows(8)
    assert pauses == [min(first * 2**i, g.MAX_PAUSE) for i in range(7)], pauses
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


def test_gate_a_host_pause_does_not_decide_a_judgement():
    """A step that took many times its stretch's median (a collection, a preempted core) is left out of the
    stretch's rate: one such step in the closed stretch must not make a losing draft look like a win, nor one in
    the open stretch close a winning bucket."""
    for plain, spec, slow_mode in ((1000.0, 700.0, False), (1000.0, 1500.0, True)):
        gate = g.SpecGate()
        n = 8
        for step in range(g.MEASURE_STEPS + 1 + g.JUDGE_STEPS):
            is_open = gate.allows(n)
            seconds = n / (spec if is_open else plain)
            if is_open == slow_mode and step == (g.MEASURE_STEPS + 4 if slow_mode else 4):
                seconds *= 30  # the host paused for ~30 steps' time
            gate.observe(is_open, n, n, seconds)
        lost = gate.closures == 1
        assert lost == (spec < plain), (plain, spec, gate.closures)


def test_gate_a_won_stretch_after_losses_halves_the_next_pause():
    """One won stretch between losses may be noise: the loss after it pauses half as long as the last one (not
    FIRST_PAUSE again), and wins in a row forget the losses."""
    gate = g.SpecGate()
    b = gate.bucket(8)
    _until_open(gate, 8, 1000.0)
    pauses = []
    for _ in range(4):  # four mild losses: the pause (short: the probes lose little) doubles
        _steps(gate, 8, 1000.0, 900.0, 1 + g.JUDGE_STEPS)
        pauses.append(gate.pause[b])
        _until_open(gate, 8, 1000.0)
    assert pauses == [pauses[0] * 2**i for i in range(4)], pauses
    _steps(gate, 8, 1000.0, 1200.0, 1 + g.PROBE_STEPS)  # a probe wins (short: the bucket lost before)
    assert gate.closures == 4 and b not in gate.pause and gate.lost[b] == pauses[-1] // 2
    _until_open(gate, 8, 1000.0)  # (decoding may be measured afresh first)
    _steps(gate, 8, 1000.0, 600.0, 1 + g.JUDGE_STEPS)  # the next stretch, judged in full, loses
    assert gate.closures == 5 and not gate.allows(8) and gate.pause[b] == pauses[-1], (gate.pause[b], pauses)
    _until_open(gate, 8, 1000.0)
    for _ in range(8):  # wins in a row: the losses are forgotten
        _steps(gate, 8, 1000.0, 1200.0, 1 + g.JUDGE_STEPS)
    assert gate.allows(8) and b not in gate.lost


def test_gate_a_larger_batch_closed_by_a_smaller_ones_loss_measures_before_its_probe():
    """A bucket closed by a smaller bucket's loss has no decoding figure of its own: when its pause ends it first
    decodes plainly (its probe's verify steps, the dearest there are, would otherwise be judged against nothing),
    then probes on a short stretch, and a loss doubles the pause it inherited rather than starting afresh."""
    gate = g.SpecGate()
    _until_open(gate, 8, 1000.0)
    _steps(gate, 8, 1000.0, 400.0, 1 + g.PROBE_STEPS)  # 8 requests: a bad loss, judged early
    inherited = gate.pause[gate.bucket(32)]
    assert inherited == gate.pause[gate.bucket(8)] and not gate.allows(32)
    while gate.step < gate.closed_until[gate.bucket(32)]:  # its pause passes while other sizes decode
        _steps(gate, 2, 1000.0, 1000.0, 1)
    opened_after = _until_open(gate, 32, 3000.0)  # no figure at 32 yet: it decodes plainly first
    assert opened_after == g.MEASURE_STEPS and gate.plain_rate(gate.bucket(32)) == pytest.approx(3000.0)
    _steps(gate, 32, 3000.0, 2000.0, 1 + g.PROBE_STEPS)  # the probe loses: judged on the short stretch
    assert not gate.allows(32) and gate.pause[gate.bucket(32)] == 2 * inherited
