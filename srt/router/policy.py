"""Which worker gets a request.

cache_aware: the worker believed to hold the longest prefix of the prompt, when that prefix is at least
`cache_threshold` of the prompt and that worker is not much busier than the least loaded one (its load at most
`balance_abs` prompt tokens above it, or `balance_rel` times it); otherwise the least loaded worker (a miss goes by
load, never to whoever holds the least). round_robin, least_load and random ignore prefixes.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from radixlm.srt.router.prefix_index import BLOCK
from radixlm.srt.router.workers import Worker

POLICIES = ("cache_aware", "round_robin", "least_load", "random")


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs: float = 4096.0
    balance_rel: float = 1.5


@dataclass
class Choice:
    worker: Worker
    matched: float  # fraction of the prompt the chosen worker is believed to hold


class Policy:
    def __init__(self, cfg: PolicyConfig, seed: int = 0):
        if cfg.name not in POLICIES:
            raise ValueError(f"unknown routing policy {cfg.name!r}; choices: {', '.join(POLICIES)}")
        self.cfg = cfg
        self._turn = itertools.count()
        self._rng = random.Random(seed)

    def choose(
        self, workers: list[Worker], names: list[int], chars: int, exclude: frozenset[str] = frozenset()
    ) -> Choice:
        """`workers`: the healthy ones; `names`: the prompt's block names (prefix_index.block_names); `chars`: its
        length. Raises LookupError when no worker may take it."""
        pool = [w for w in workers if w.url not in exclude]
        if not pool:
            raise LookupError("no worker is available")
        matches = {w.url: w.index.match(names) for w in pool}
        name = self.cfg.name
        if name == "round_robin":
            w = pool[next(self._turn) % len(pool)]
        elif name == "random":
            w = self._rng.choice(pool)
        else:
            loads = {w.url: w.load() for w in pool}
            least = min(loads.values())
            # the least loaded; among equals the one holding most of the prompt, then in turn
            turn = next(self._turn)
            by_load = min(
                pool,
                key=lambda w: (loads[w.url], -matches[w.url], (pool.index(w) - turn) % len(pool)),
            )
            w = by_load
            if name == "cache_aware" and names:
                best = max(pool, key=lambda w: (matches[w.url], -loads[w.url]))
                covered = matches[best.url] * BLOCK / max(chars, 1)
                cfg = self.cfg
                balanced = loads[best.url] <= least + cfg.balance_abs or loads[best.url] <= cfg.balance_rel * least
                if covered >= cfg.cache_threshold and balanced:
                    w = best
        w.index.insert(names)
        return Choice(w, min(1.0, matches[w.url] * BLOCK / max(chars, 1)))
