"""The decode batch: every running request that is worth another step, one new token each. When the KV cache
cannot hold one more token for each of them, cached prefixes are evicted first, then the least advanced
requests are retracted (their KV goes back, they rejoin the waiting queue and are recomputed later)."""

from __future__ import annotations

import logging

from radixlm.srt.mem_cache.memory_pool import ReqToTokenPool
from radixlm.srt.scheduler.batch import ScheduledBatch, build_decode
from radixlm.srt.scheduler.kv import ReqKV
from radixlm.srt.scheduler.req import Req

logger = logging.getLogger(__name__)


def make_room(running: list[Req], kv: ReqKV, context_length: int) -> list[Req]:
    """Evict, then retract, until every decodable running request has a slot; returns the retracted requests
    (taken off `running`, their KV released)."""
    retracted = []
    while True:
        decoding = [r for r in running if r.decodable(context_length)]
        short = len(decoding) - kv.kv_pool.available_size()
        if short <= 0:
            return retracted
        kv.tree_cache.evict(short)
        if kv.kv_pool.available_size() >= len(decoding) or len(decoding) == 1:
            return retracted
        r = min(decoding, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        running.remove(r)
        kv.release(r)
        r.epoch += 1  # a token it still has in flight is dropped; it is sampled again after re-admission
        r.pending_ref = None
        r.retractions += 1
        retracted.append(r)
        logger.debug("retracted %s after %d tokens", r.rid, len(r.output_ids))


def schedule_decode(
    running: list[Req], kv: ReqKV, req_pool: ReqToTokenPool, context_length: int
) -> ScheduledBatch | None:
    reqs = [r for r in running if r.decodable(context_length)]
    return build_decode(reqs, kv.alloc(len(reqs)), req_pool) if reqs else None
