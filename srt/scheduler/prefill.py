"""Admission: which waiting requests (and which chunk of a long prompt) join the next extend batch.

Requests are taken in policy order while KV memory allows: free slots plus evictable cache, minus a reserve for
the decode growth of everything running (each request's remaining tokens scaled by an adaptive ratio that
drops as requests finish early and snaps back to 1 after a retraction)."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.srt.scheduler.kv import ReqKV
from radixlm.srt.scheduler.policy import SchedulePolicy
from radixlm.srt.scheduler.req import Req

CLIP_MAX_NEW_TOKENS = 4096  # cap on the decode growth one request is assumed to need at admission
IN_BATCH_PREFIX_MIN = 32  # defer a request that shares at least this many uncached tokens with one admitted now


@dataclass
class PrefillBudget:
    """What one extend batch may take on."""

    tokens: int  # new prompt tokens
    split: bool  # a prompt longer than `tokens` is split into chunks (else it waits for an empty batch)
    running_slots: int  # requests that may still start running
    new_token_ratio: float  # expected share of a request's max_new_tokens it will still generate
    conservativeness: float  # scale of that decode-growth reserve

    def reserve(self, r: Req) -> float:
        """KV the request is expected to need for the tokens it has yet to generate."""
        left = min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
        return left * self.new_token_ratio * self.conservativeness


@dataclass
class Admitted:
    batch: list[Req]  # each with `extend_len` set
    chunked: Req | None  # the request whose prompt continues in a later batch


class Admission:
    def __init__(self, policy: SchedulePolicy, kv: ReqKV, share_prefixes: bool):
        self.policy = policy
        self.kv = kv
        # With a radix cache, a request sharing a long uncached prefix with one admitted now waits a step and
        # finds it cached, instead of computing it twice.
        self.share_prefixes = share_prefixes

    def admit(
        self, waiting: list[Req], running: list[Req], chunked: Req | None, inflight: list[Req], budget: PrefillBudget
    ) -> Admitted:
        """Take requests off `waiting` (and the next chunk of `chunked`). `inflight`: the prompts of an extend
        launched but not yet processed (overlap), which reach the tree only once processed."""
        tokens = budget.tokens
        reserved = sum(budget.reserve(r) for r in running)
        batch: list[Req] = []
        if chunked is not None:
            r = chunked
            left = len(r.fill_ids) - r.kv_len
            n = int(min(left, tokens, self.kv.room() - reserved))
            if n <= 0:
                return Admitted([], chunked)
            r.extend_len = n
            batch.append(r)
            if n < left:
                return Admitted(batch, chunked)
            chunked = None
            tokens -= n
            reserved += n + budget.reserve(r)
        if tokens <= 0 or not waiting:
            return Admitted(batch, chunked)
        for r in self.policy.order(waiting):
            if len(batch) >= budget.running_slots or self.kv.req_pool.available_size() == 0:
                break
            limit = len(r.fill_ids) - 1  # the last token is always computed: its logits are needed
            if r.wants_input_logprobs() and not r.output_ids:
                limit = min(limit, max(r.logprob_start_len - 1, 0))
            self.kv.tree_cache.match_req(r, limit)
            prefix = len(r.prefix_slots)
            if self.share_prefixes and (_shares(r, prefix, batch) or _shares(r, prefix, inflight)):
                self.kv.unlock(r)  # its prefix will be cached once the batch runs; take it next step
                continue
            extend = len(r.fill_ids) - prefix
            reserve = budget.reserve(r)
            free = self.kv.room() - reserved
            if extend + reserve > free and (batch or running or extend > free):
                self.kv.unlock(r)
                break
            waiting.remove(r)
            batch.append(r)
            if extend > tokens and budget.split:
                r.extend_len = tokens
                return Admitted(batch, r)
            r.extend_len = extend
            tokens -= extend
            reserved += extend + reserve
            if tokens <= 0:
                break
        return Admitted(batch, chunked)


def _shares(r: Req, prefix: int, batch: list[Req]) -> bool:
    """Whether `r` shares at least IN_BATCH_PREFIX_MIN tokens past its cached prefix with one of `batch`."""
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
