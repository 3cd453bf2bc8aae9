"""Compiling grammars off the scheduler loop: a worker pool, an LRU cache of compiled grammars (failures are
cached too, so a bad spec fails fast the next time), and a per-request time limit."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from radixlm.srt.constrained.base import CompiledGrammar, GrammarBackend, GrammarSpec
from radixlm.srt.errors import GrammarError

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 512


def create_backend(name: str, tokenizer, vocab_size: int, stop_ids: list[int]) -> GrammarBackend | None:
    if name == "none":
        return None
    if name == "outlines":
        from radixlm.srt.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend(tokenizer, vocab_size, stop_ids)
    if name == "xgrammar":
        from radixlm.srt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_ids)
    raise ValueError(f"unknown grammar backend {name!r}")


COMPILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
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
    spec: GrammarSpec
    future: Future
    started: float
    deadline: float

    def poll(self) -> CompiledGrammar | GrammarError | None:
        """The compiled grammar, the error that ended it, or None while still compiling."""
        if self.future.done():
            err = self.future.exception()
            return err if err is not None else self.future.result()
        if time.monotonic() > self.deadline:
            return GrammarError(f"compiling the {self.spec.describe()} took longer than "
                                f"{self.deadline - self.started:.0f} s (--grammar-compile-timeout); simplify it",
                                param=self.spec.kind)
        return None


class GrammarManager:
    def __init__(self, backend: GrammarBackend, workers: int = 4, timeout: float = 60.0):
        self.backend = backend
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self.cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self.stats = GrammarStats()

    def request(self, spec: GrammarSpec) -> GrammarTicket:
        now = time.monotonic()
        fut = self.cache.get(spec)
        if fut is not None:
            self.cache.move_to_end(spec)
            self.stats.cache_hits += 1
        else:
            fut = self.pool.submit(self._compile, spec)
            self.cache[spec] = fut
            while len(self.cache) > _CACHE_ENTRIES:
                self.cache.popitem(last=False)
        return GrammarTicket(spec, fut, now, now + self.timeout)

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
            raise GrammarError(f"the {spec.describe()} cannot be compiled: {type(e).__name__}: {e}",
                               param="tools" if spec.kind == "tool_call" else spec.kind) from None
        finally:
            self.stats.compiles += 1
            self.stats.observe_compile(time.perf_counter() - start)

    def forget(self, spec: GrammarSpec) -> None:
        """Drop a cached entry (a compile that timed out: the next request for it tries again)."""
        self.cache.pop(spec, None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
