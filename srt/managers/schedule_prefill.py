"""Admission: which waiting requests (and which chunk of a long prompt) join the next extend batch.

Requests are taken in policy order while KV memory allows: free slots plus evictable cache, minus a reserve for
the decode growth of everything running (each request's remaining tokens scaled by an adaptive ratio that
drops as requests finish early and snaps back to 1 after a retraction)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from radixlm.srt.managers.req import Req
from radixlm.srt.mem_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from radixlm.srt.managers.scheduler import Scheduler

CLIP_MAX_NEW_TOKENS = 4096  # cap on the decode growth one request is assumed to need at admission
IN_BATCH_PREFIX_MIN = 32  # defer a request that shares at least this many uncached tokens with one admitted now


def decode_reserve(s: Scheduler, r: Req) -> float:
    left = min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
    return left * s.new_token_ratio * s.conservativeness


def room(s: Scheduler, reserved: float) -> float:
    return s.kv_pool.available_size() + s.tree_cache.evictable_size() - reserved


def schedule_extend(s: Scheduler) -> list[Req]:
    """The requests of the next extend batch, each with `extend_len` set; [] when none is admissible."""
    if not s.waiting and s.chunked is None:
        return []
    budget = min(s.max_prefill_tokens, s.chunk_size or s.max_prefill_tokens)
    limited = s.chunk_size is not None  # a prompt over the budget is split, not held back
    if s.decode_prefill_budget is not None and any(r.decodable(s.context_length) for r in s.running):
        budget, limited = min(budget, s.decode_prefill_budget), True
    reserved = sum(decode_reserve(s, r) for r in s.running)
    batch: list[Req] = []
    if s.chunked is not None:
        r = s.chunked
        left = len(r.fill_ids) - r.kv_len
        n = int(min(left, budget, room(s, reserved)))
        if n <= 0:
            return []
        r.extend_len = n
        batch.append(r)
        if n < left:
            return batch
        s.chunked = None
        budget -= n
        reserved += n + decode_reserve(s, r)
    if budget <= 0 or not s.waiting:
        return batch
    is_radix = isinstance(s.tree_cache, RadixCache)
    # With overlap, the extend launched last step publishes its prompts to the tree only after this schedule:
    # a request sharing a prompt with it waits one step rather than compute the shared part again.
    inflight = s.inflight.reqs if s.inflight is not None and not s.inflight.mode.is_decode else []
    for r in s.policy.order(s.waiting):
        if len(s.running) + len(batch) >= s.max_running or s.req_pool.available_size() == 0:
            break
        limit = len(r.fill_ids) - 1  # the last token is always computed: its logits are needed
        if r.wants_input_logprobs() and not r.output_ids:
            limit = min(limit, max(r.logprob_start_len - 1, 0))
        s.tree_cache.match_req(r, limit)
        prefix = len(r.prefix_slots)
        if is_radix and (_shares_with_batch(r, prefix, batch) or _shares_with_batch(r, prefix, inflight)):
            s.unlock(r)  # its prefix will be cached once the batch runs; take it next step
            continue
        extend = len(r.fill_ids) - prefix
        reserve = decode_reserve(s, r)
        free = room(s, reserved)
        if extend + reserve > free and (batch or s.running or extend > free):
            s.unlock(r)
            break
        s.waiting.remove(r)
        batch.append(r)
        if extend > budget and limited:
            r.extend_len = budget
            s.chunked = r
            break
        r.extend_len = extend
        budget -= extend
        reserved += extend + reserve
        if budget <= 0:
            break
    return batch


def _shares_with_batch(r: Req, prefix: int, batch: list[Req]) -> bool:
    ids = r.fill_ids
    for other in batch:
        o = other.fill_ids
        n = min(len(ids), len(o)) - 1
        i = prefix
        while i < n and ids[i] == o[i]:
            i += 1
        if i - prefix >= IN_BATCH_PREFIX_MIN:
            return True
    return False
