"""The router's view of its workers: whether each answers, the load it last reported, the requests the router has
sent it since, and its prefix index.

Load is what a worker reports on `/load` (prompt tokens waiting, requests running, KV cache in use), plus the
prompts the router sent it after that report that are still open (a burst of requests lands between two reports).
A worker whose KV cache is nearly full ranks behind every other one: request counts alone miss it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from radixlm.srt.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

RUNNING_COST = 64  # a running request's weight in prompt tokens: a share of every decode step it rides
KV_FULL = 0.9  # KV use above which a worker takes new prompts only when every worker is that full
DOWN_AFTER = 3  # failed health checks in a row before a worker is marked down (at once when nothing listens)


@dataclass
class LoadReport:
    waiting_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_used: float = 0.0  # fraction of the KV pool held by running requests (cached, evictable prefixes excluded)
    at: float = 0.0  # time.monotonic() of the report


@dataclass
class Worker:
    url: str
    index: PrefixIndex
    up: bool = True
    fails: int = 0
    report: LoadReport = field(default_factory=LoadReport)
    open: dict[int, tuple[float, int]] = field(default_factory=dict)  # request id -> (sent at, prompt tokens)
    sent: int = 0

    def load(self) -> float:
        r = self.report
        since = sum(tokens for t, tokens in self.open.values() if t > r.at)
        score = r.waiting_tokens + since + RUNNING_COST * r.num_running
        return score + (1e9 if r.kv_used > KV_FULL else 0.0)


class WorkerSet:
    def __init__(self, urls: list[str], index_capacity: int, health_interval_s: float):
        self.index_capacity = index_capacity
        self.health_interval_s = health_interval_s
        self.workers: dict[str, Worker] = {}
        for url in urls:
            self.add(url)
        self._next_id = 0

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        if url not in self.workers:
            self.workers[url] = Worker(url, PrefixIndex(self.index_capacity))
            logger.info("worker added: %s", url)
        return self.workers[url]

    def remove(self, url: str) -> bool:
        gone = self.workers.pop(url.rstrip("/"), None)
        if gone is not None:
            logger.info("worker removed: %s", url)
        return gone is not None

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.up]

    # --- requests in flight ---------------------------------------------------------------------------------
    def opened(self, w: Worker, tokens: int) -> int:
        self._next_id += 1
        w.open[self._next_id] = (time.monotonic(), tokens)
        w.sent += 1
        return self._next_id

    def closed(self, w: Worker, rid: int) -> None:
        w.open.pop(rid, None)

    def failed(self, w: Worker) -> None:
        """A request could not reach `w`: no new requests until a health check finds it again."""
        if w.up:
            logger.warning("worker %s marked down (a request could not reach it)", w.url)
        w.up, w.fails = False, DOWN_AFTER

    # --- health ------------------------------------------------------------------------------------------------
    async def check(self, client: httpx.AsyncClient, w: Worker) -> None:
        try:
            # generous: a worker busy with a long step on a shared host answers late but is not down
            r = await client.get(f"{w.url}/load", timeout=max(5.0, 2 * self.health_interval_s))
            r.raise_for_status()
            d = r.json()
        except (httpx.HTTPError, ValueError) as e:
            w.fails = DOWN_AFTER if isinstance(e, httpx.ConnectError) else w.fails + 1
            if w.up and w.fails >= DOWN_AFTER:
                w.up = False
                logger.warning("worker %s marked down: %s", w.url, type(e).__name__)
            return
        kv_total = max(1, d.get("kv_total", 1))
        w.report = LoadReport(
            waiting_tokens=int(d.get("waiting_tokens", 0)),
            num_waiting=int(d.get("num_waiting", 0)),
            num_running=int(d.get("num_running", 0)),
            kv_used=d.get("kv_used", 0) / kv_total,
            at=time.monotonic(),
        )
        if not w.up:
            w.index.clear()  # it may have restarted: whatever it cached before is gone
            logger.info("worker %s is up", w.url)
        w.up, w.fails = True, 0

    async def watch(self, client: httpx.AsyncClient) -> None:
        """Check every worker each health interval, for as long as the router runs."""
        while True:
            await asyncio.gather(*(self.check(client, w) for w in list(self.workers.values())))
            await asyncio.sleep(self.health_interval_s)
