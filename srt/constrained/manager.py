"""Compiling grammars off the scheduler loop: a thread per compile (at most `workers` at once), an LRU cache of
compiled grammars (failures are cached too, so a bad spec fails fast the next time), and a per-request time limit.

A compile shares the CPU with the forward pass; on a small CPU host a long one (a pathological regex) would slow
every decode step severalfold, as torch's worker threads wait on the core it holds. Typical compiles take well
under a second, so a compile that has used DEMOTE_AFTER_S of CPU time (or whose request has timed out) is lowered
to the lowest CPU priority: it finishes on idle cycles. CPU time, not wall time: on a busy host an ordinary compile
sharing the cores with the forward pass can run for seconds by the clock, and lowering it there would starve it
(at the lowest priority it gets about 1/70 of a core beside busy torch threads) until its request times out.
Lowering is one-way for an unprivileged process, which is why each compile has its own thread instead of a pool's
reused one."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec
from radixlm.srt.errors import GrammarError, GrammarTimeout, GrammarWorkersBusy

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 512
DEMOTE_AFTER_S = 2.0
_LOWEST_PRIORITY = 19


def create_backend(name: str, tokenizer, vocab_size: int, stop_ids: list[int]) -> GrammarBackend | None:
    if name == "none":
        return None
    if name == "auto":
        return AutoBackend(tokenizer, vocab_size, stop_ids)
    if name == "outlines":
        from radixlm.srt.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend(tokenizer, vocab_size, stop_ids)
    if name == "xgrammar":
        from radixlm.srt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_ids)
    if name == "llguidance":
        from radixlm.srt.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_ids)
    raise ValueError(f"unknown grammar backend {name!r}")


class AutoBackend(GrammarBackend):
    """Each spec compiled by the first backend of spec.AUTO_ORDER that enforces all of it (the edge made the same
    choice when it accepted the request). A backend is built the first time a spec needs it."""

    name = "auto"

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self._args = (tokenizer, vocab_size, stop_ids)
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()

    def backend(self, name: str) -> GrammarBackend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = create_backend(name, *self._args)
            return self._backends[name]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        from radixlm.srt.constrained.spec import check_supported

        return self.backend(check_supported(spec, "auto")).compile(spec)

    def promotion(self, spec: GrammarSpec) -> GrammarBackend | None:
        """A JSON schema that llguidance and outlines both enforce moves to outlines once its index is built:
        llguidance compiles in a millisecond, which is why new schemas start there, but fills a mask row inside a
        length-bounded string in 0.2-1 ms against outlines' precomputed rows in microseconds. The two backends
        accept the same answers (their scalars are aligned: tests/constrained/test_backend_language.py), though
        a greedy answer's tokens may differ (llguidance allows only the canonical tokens of text the grammar
        forces). Not for schemas whose regex could make a large index (long bounded repetitions, long regexes)."""
        from radixlm.srt.constrained.outlines_backend import index_is_small, regex_for
        from radixlm.srt.constrained.spec import check_supported, enforces

        if spec.kind != "json_schema" or check_supported(spec, "auto") != "llguidance":
            return None
        if not enforces(spec, "outlines"):
            return None
        try:
            regex = regex_for(spec)
        except GrammarError:
            return None
        return self.backend("outlines") if index_is_small(regex) else None


COMPILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


def _cpu_clock() -> int | None:
    """The calling thread's CPU-time clock (None where the platform has none: such compiles are never demoted)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _cpu_seconds(clock: int | None) -> float:
    if clock is None:
        return 0.0
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread has just ended (its record is about to go)
        return 0.0


def _succeeded(fut: Future) -> bool:
    """A done future that holds a result."""
    return not fut.cancelled() and fut.exception() is None


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    promotions: int = 0  # specs whose later requests moved to a backend with cheaper masks (AutoBackend.promotion)
    failures: int = 0
    timeouts: int = 0
    # A histogram of compile times kept as counts per bucket (Prometheus reads it from the scheduler's stats)
    compile_seconds_sum: float = 0.0
    compile_buckets: list[int] = field(default_factory=lambda: [0] * len(COMPILE_BUCKETS))

    def observe_compile(self, seconds: float) -> None:
        self.compile_seconds_sum += seconds
        for i, bound in enumerate(COMPILE_BUCKETS):
            if seconds <= bound:
                self.compile_buckets[i] += 1


@dataclass(eq=False)
class GrammarTicket:
    """One request's wait for a compile. Its time limit runs from when the compile started (or from the request, if
    it joined one already running): a compile waiting for a free worker has not started yet, and a burst of
    distinct grammars on a small host may queue for longer than the limit. The wait for a worker is bounded too:
    it fails only if no worker has come free (no compile started or ended) for the whole limit."""

    spec: GrammarSpec
    future: Future
    created: float
    manager: "GrammarManager"

    def poll(self) -> CompiledGrammar | GrammarError | None:
        """The compiled grammar, the error that ended it, or None while still compiling."""
        if self.future.done():
            err = self.future.exception()
            return err if err is not None else self.future.result()
        now, limit = time.monotonic(), self.manager.timeout
        started = self.manager.started_at(self.future)
        if started is not None:
            if now - max(started, self.created) > limit:
                return GrammarTimeout(
                    f"compiling the {self.spec.describe()} took longer than {limit:g} s "
                    "(--grammar-compile-timeout); simplify it",
                    param=self.spec.kind,
                )
        elif now - max(self.created, self.manager.last_progress) > limit:
            return GrammarWorkersBusy(
                f"no grammar compile worker came free in {limit:g} s: slow compiles hold them all; retry later",
                param=self.spec.kind,
            )
        return None


class GrammarManager:
    def __init__(self, backend: GrammarBackend, workers: int = 4, timeout: float = 60.0, promote: bool = True):
        self.backend = backend
        self.timeout = timeout
        # Promotion (backend.promotion): a spec asked for again is compiled on the target backend in the
        # background, one at a time at the lowest CPU priority; the cache then serves that grammar to new requests
        self.promote = promote
        self._promoting: GrammarSpec | None = None
        self._promoted: dict[GrammarSpec, CompiledGrammar] = {}  # built, waiting for request() to swap it in
        self._settled: set[GrammarSpec] = set()  # promoted, being promoted, or staying where they are
        self._wanted: set[GrammarSpec] = set()  # asked for again while their first compile was running
        self.cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self.stats = GrammarStats()
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._active: dict[Future, list] = {}  # compiling now: [native thread id, CPU clock id, demoted, started]
        self.last_progress = time.monotonic()  # when a compile last started or ended: the queue is moving
        self._wake = threading.Event()
        self._closed = False
        threading.Thread(target=self._watch, name="grammar-watchdog", daemon=True).start()

    def request(self, spec: GrammarSpec) -> GrammarTicket:
        now = time.monotonic()
        fut = self.cache.get(spec)
        if fut is not None:
            self.cache.move_to_end(spec)
            self.stats.cache_hits += 1
            with self._lock:
                ready = self._promoted.pop(spec, None)
            if ready is not None:
                fut = Future()
                fut.set_result(ready)
                self.cache[spec] = fut
                self.stats.promotions += 1
            elif self.promote and spec not in self._settled:
                if not fut.done():  # asked for again while its first compile runs (a burst): promote when that ends
                    self._wanted.add(spec)
                elif _succeeded(fut):
                    self._maybe_promote(spec)
        else:
            with self._lock:  # an evicted spec compiles afresh, and may be promoted afresh
                self._promoted.pop(spec, None)
            self._settled.discard(spec)
            self._wanted.discard(spec)
            fut = Future()
            threading.Thread(target=self._run, args=(spec, fut), name="grammar", daemon=True).start()
            self.cache[spec] = fut
            while len(self.cache) > _CACHE_ENTRIES:
                self.cache.popitem(last=False)
        return GrammarTicket(spec, fut, now, self)

    def _maybe_promote(self, spec: GrammarSpec) -> None:
        """Start moving `spec` to the backend its promotion names, unless another move is under way (a later
        request asks again) or it was settled before. Called from the scheduler thread and from compile threads."""
        with self._lock:
            if self._promoting is not None or spec in self._settled:
                return
            if len(self._settled) >= 4 * _CACHE_ENTRIES:  # forget old verdicts rather than grow without bound
                self._settled.clear()
            self._settled.add(spec)
            self._promoting = spec
        try:
            target = self.backend.promotion(spec)
        except Exception as e:  # noqa: BLE001 - an optimisation: the spec just stays where it is
            logger.debug("no promotion for a %s: %s", spec.describe(), e)
            target = None
        if target is None:
            self._promoting = None
            return
        threading.Thread(target=self._promote, args=(spec, target), name="grammar-promote", daemon=True).start()

    def _promote(self, spec: GrammarSpec, target: GrammarBackend) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
        except (OSError, AttributeError):
            pass
        start = time.perf_counter()
        try:
            compiled = target.compile(spec)
        except Exception as e:  # noqa: BLE001 - it stays on the backend that compiled it first
            logger.info("a %s stays on its first grammar backend: %s could not compile it: %s",
                        spec.describe(), target.name, e)  # fmt: skip
        else:
            took = time.perf_counter() - start
            logger.debug("a %s moves to %s (built in %.2f s)", spec.describe(), target.name, took)
            with self._lock:
                self._promoted[spec] = compiled
        finally:
            self._promoting = None

    def started_at(self, fut: Future) -> float | None:
        """When the compile behind `fut` started; None while it waits for a worker."""
        rec = self._active.get(fut)
        return rec[3] if rec is not None else None

    def _run(self, spec: GrammarSpec, fut: Future) -> None:
        with self._slots:
            if self._closed or not fut.set_running_or_notify_cancel():
                return
            with self._lock:
                self.last_progress = now = time.monotonic()
                self._active[fut] = [threading.get_native_id(), _cpu_clock(), False, now]
            self._wake.set()
            try:
                fut.set_result(self._compile(spec))
            except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the future
                fut.set_exception(e)
            else:
                if spec in self._wanted:
                    self._wanted.discard(spec)
                    self._maybe_promote(spec)
            finally:
                with self._lock:  # before the thread ends, so a demotion never reaches a reused thread id
                    self._active.pop(fut, None)
                    self.last_progress = time.monotonic()

    def _demote(self, fut: Future, why: str) -> None:
        with self._lock:
            rec = self._active.get(fut)
            if rec is None or rec[2]:
                return
            rec[2] = True
            try:
                os.setpriority(os.PRIO_PROCESS, rec[0], _LOWEST_PRIORITY)
            except (OSError, AttributeError):  # not Linux, or not allowed: it just keeps its priority
                return
        logger.info("grammar compile %s; it goes on at the lowest CPU priority", why)

    def _watch(self) -> None:
        while not self._closed:
            self._wake.wait(0.25 if self._active else None)
            self._wake.clear()
            with self._lock:
                slow = [
                    f
                    for f, (_, clock, demoted, _) in self._active.items()
                    if not demoted and _cpu_seconds(clock) > DEMOTE_AFTER_S
                ]
            for fut in slow:
                self._demote(fut, f"has used more than {DEMOTE_AFTER_S:.0f} s of CPU time")

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            return self.backend.compile(spec)
        except GrammarError:
            self.stats.failures += 1
            raise
        except Exception as e:  # a backend bug or a panic: still only this request's problem
            self.stats.failures += 1
            logger.warning("grammar compile crashed: %s: %s", type(e).__name__, e)
            raise GrammarError(
                f"the {spec.describe()} cannot be compiled: {type(e).__name__}: {e}",
                param="tools" if spec.kind == "tool_call" else spec.kind,
            ) from None
        finally:
            self.stats.compiles += 1
            self.stats.observe_compile(time.perf_counter() - start)

    def forget(self, spec: GrammarSpec) -> None:
        """Drop a cached entry (a compile that timed out: the next request for it tries again)."""
        fut = self.cache.pop(spec, None)
        if fut is not None:
            self._demote(fut, "outlived its request's time limit")

    def shutdown(self) -> None:
        self._closed = True
        self._wake.set()
        for fut in list(self.cache.values()):
            fut.cancel()  # compiles not started yet never start
