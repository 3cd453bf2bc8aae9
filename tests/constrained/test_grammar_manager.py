"""GrammarManager lowers the CPU priority of a compile by the CPU time it has used, not by how long it has run.

A compile that waits (here it sleeps, as one does on a host whose cores the forward pass keeps busy) must keep its
priority: lowered, it would starve beside busy torch threads until its request timed out. One that burns CPU past
DEMOTE_AFTER_S is lowered. The backend here is a stand-in whose only job is to wait or to burn; the real backends'
compiles are tested through the scheduler in test_grammar_scheduler.py."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec
from radixlm.srt.constrained.manager import DEMOTE_AFTER_S, GrammarManager

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are Linux's")


class _TimedBackend(GrammarBackend):
    """Spec "wait:S" sleeps S seconds; "burn:S" spins on the CPU for S seconds of its own CPU time. Each compile
    reports the priority its thread had when it ended (the result object is that number)."""
    name = "timed"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        how, seconds = spec.spec.split(":")
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
