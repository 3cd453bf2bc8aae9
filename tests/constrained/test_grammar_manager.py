"""GrammarManager's time limits and CPU priorities, with a stand-in backend whose compiles only wait or burn CPU
(the real backends' compiles are tested through the scheduler in test_grammar_scheduler.py).

- A compile is lowered in CPU priority by the CPU time it has used, not by how long it has run: one that waits
  (here it sleeps, as one does on a host whose cores the forward pass keeps busy) keeps its priority (lowered, it
  would starve beside busy torch threads until its request timed out); one that burns CPU past DEMOTE_AFTER_S is
  lowered.
- A request's time limit runs from when its compile starts: a burst of grammars queued behind each other all
  compile, however long the queue. Only when no worker comes free for the whole limit do queued requests fail,
  with a 503 (the server's state), while the compile that ran too long fails with a 400."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec
from radixlm.srt.constrained.manager import DEMOTE_AFTER_S, GrammarManager
from radixlm.srt.errors import GrammarTimeout, GrammarWorkersBusy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are Linux's")


class _TimedBackend(GrammarBackend):
    """Spec "wait:S" sleeps S seconds; "burn:S" spins on the CPU for S seconds of its own CPU time. Each compile
    reports the priority its thread had when it ended (the result object is that number). A spec's text after a
    second colon only makes it a distinct cache entry."""

    name = "timed"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        how, seconds = spec.spec.split(":")[:2]
        if how == "wait":
            time.sleep(float(seconds))
        else:
            while time.thread_time() < float(seconds):
                pass
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # type: ignore[return-value]


def test_waiting_compile_keeps_priority_and_burning_one_is_lowered():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    manager = GrammarManager(_TimedBackend(), workers=2, timeout=60)
    try:
        seconds = DEMOTE_AFTER_S + 1.5
        waiting = manager.request(GrammarSpec("regex", f"wait:{seconds}"))
        burning = manager.request(GrammarSpec("regex", f"burn:{seconds}"))
        deadline = time.monotonic() + 60
        while not (waiting.future.done() and burning.future.done()):
            assert time.monotonic() < deadline, "compiles did not end"
            time.sleep(0.05)
        assert waiting.poll() == base, "a compile that only waited was lowered"
        assert burning.poll() == 19, "a compile that used more than DEMOTE_AFTER_S of CPU kept its priority"
    finally:
        manager.shutdown()


def _wait_all(tickets, limit_s: float = 60.0) -> list:
    """Poll like the scheduler does until every ticket has a result; the results in order."""
    results = [None] * len(tickets)
    deadline = time.monotonic() + limit_s
    while any(r is None for r in results):
        assert time.monotonic() < deadline, "tickets did not end"
        results = [r if r is not None else t.poll() for r, t in zip(results, tickets)]
        time.sleep(0.02)
    return results


def test_queued_compiles_are_not_timed_out_while_the_queue_moves():
    # One worker, a 1 s limit, five 0.3 s compiles: the last waits about 1.2 s for the worker, past the limit,
    # yet each compile takes under a third of it.
    manager = GrammarManager(_TimedBackend(), workers=1, timeout=1.0)
    try:
        tickets = [manager.request(GrammarSpec("regex", f"wait:0.3:{i}")) for i in range(5)]
        results = _wait_all(tickets)
        assert all(isinstance(r, int) for r in results), results
    finally:
        manager.shutdown()


def test_a_compile_past_the_limit_fails_400_and_those_queued_behind_it_503():
    manager = GrammarManager(_TimedBackend(), workers=1, timeout=0.5)
    try:
        slow = manager.request(GrammarSpec("regex", "wait:5"))
        queued = manager.request(GrammarSpec("regex", "wait:0"))
        started = time.monotonic()
        slow_result, queued_result = _wait_all([slow, queued])
        assert isinstance(slow_result, GrammarTimeout) and slow_result.status == 400, slow_result
        assert "took longer than" in slow_result.message
        assert isinstance(queued_result, GrammarWorkersBusy) and queued_result.status == 503, queued_result
        assert "no grammar compile worker came free" in queued_result.message
        assert time.monotonic() - started < 4, "the queued request waited for the slow compile to end"
    finally:
        manager.shutdown()
