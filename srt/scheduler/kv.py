"""A request's KV memory as the scheduler sees it: the slots of its row in the request table, the shared prefix
it holds in the radix tree, and the private tail it computed itself.

Every slot is in exactly one place: the free list, a radix node, or a running request's private tail
(`check_invariants`). Everything that moves slots between those places is here.
"""

from __future__ import annotations

import torch

from radixlm.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlm.srt.mem_cache.radix_cache import ChunkCache, RadixCache
from radixlm.srt.scheduler.req import Req


class KVExhausted(RuntimeError):
    """No slots left even after evicting every unlocked cached prefix (admission prevents it)."""


class ReqKV:
    def __init__(self, kv_pool: TokenToKVPool, req_pool: ReqToTokenPool, tree_cache: RadixCache | ChunkCache):
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.tree_cache = tree_cache

    def room(self) -> int:
        """Slots a batch can get: free ones plus cached prefixes nobody holds."""
        return self.kv_pool.available_size() + self.tree_cache.evictable_size()

    def alloc(self, n: int) -> torch.Tensor:
        short = n - self.kv_pool.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise KVExhausted(f"KV cache exhausted: need {n} slots, {self.kv_pool.available_size()} free")
        return slots

    def unlock(self, r: Req) -> None:
        """Give back a prefix matched at admission by a request that is not admitted after all."""
        if r.last_node is not None:
            self.tree_cache.dec_lock_ref(r.last_node)
        r.prefix_slots, r.last_node = torch.empty(0, dtype=torch.int64), None

    def take_row(self, r: Req) -> None:
        """A row in the request table for a newly admitted request, holding its matched prefix."""
        r.req_pool_idx = self.req_pool.alloc()
        r.kv_len = len(r.prefix_slots)
        self.req_pool.write(r.req_pool_idx, 0, r.prefix_slots)

    def release(self, r: Req) -> None:
        """Hand a request's computed tokens to the tree and its row back; it holds nothing afterwards."""
        if r.req_pool_idx is not None:
            slots = self.req_pool.slots(r.req_pool_idx, r.kv_len)
            # A slot past the known tokens holds the KV of a token still in flight: nothing can reuse it
            # before that step is done, and the tree cannot key it, so it goes straight back to the pool.
            known = min(r.kv_len, len(r.fill_ids))
            self.kv_pool.free(slots[known:])
            r.kv_len = known
            self.tree_cache.cache_finished_req(r, slots[:known])
            self.req_pool.free(r.req_pool_idx)
            r.req_pool_idx = None
        elif r.last_node is not None:
            self.unlock(r)
        r.kv_len = 0

    def truncate(self, r: Req, n: int) -> None:
        """Free the request's private slots past its first n tokens (never its shared prefix)."""
        if r.req_pool_idx is None or r.kv_len <= n:
            return
        n = max(n, len(r.prefix_slots))
        # only the freed part of the row is read (a verify step truncates every request whose draft failed)
        self.kv_pool.free(self.req_pool.slot_range(r.req_pool_idx, n, r.kv_len))
        r.kv_len = n

    def publish_prefix(self, r: Req) -> None:
        """Put the request's computed tokens into the tree so others can share them while it runs."""
        n = min(r.kv_len, len(r.fill_ids))
        if n <= len(r.prefix_slots):
            return
        kv_len, r.kv_len = r.kv_len, n
        self.tree_cache.cache_unfinished_req(r, self.req_pool.slots(r.req_pool_idx, n))
        r.kv_len = kv_len
        self.req_pool.write(r.req_pool_idx, 0, r.prefix_slots)

    def check_invariants(self, active: list[Req]) -> None:
        """Every slot is free, in the tree, or private to exactly one of the `active` requests."""
        private = sum(r.kv_len - len(r.prefix_slots) for r in active)
        total = self.kv_pool.available_size() + self.tree_cache.total_size() + private
        assert total == self.kv_pool.size, f"slot leak: free+cached+private={total} != {self.kv_pool.size}"
        assert len(torch.unique(self.kv_pool.free_slots())) == self.kv_pool.available_size(), "slot freed twice"
        assert self.req_pool.available_size() + len(active) == self.req_pool.size, "request row leak"
