"""Random insert/match/lock/unlock/evict/flush sequences against a reference model of the cache.

The reference maps every cached prefix (a tuple of tokens) to the KV slot of its last token, so "the longest
cached prefix" is a dictionary lookup; the pool is real, and every slot must stay in exactly one place.
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixlm.srt.mem_cache.memory_pool import TokenToKVPool
from radixlm.srt.mem_cache.radix_cache import RadixCache

POOL = 48
seqs = st.lists(st.integers(0, 3), min_size=1, max_size=9)


def tree_content(cache: RadixCache) -> dict[tuple, int]:
    out, stack = {}, [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key, child.value.tolist()):
                p = p + (tok,)
                out[p] = slot
            stack.append((child, p))
    return out


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = TokenToKVPool(POOL, 1, 1, 1, torch.float32, torch.device("cpu"))
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple, int] = {}
        self.locks: list[tuple[tuple, object]] = []

    def _ref_match(self, seq) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.ref:
            n += 1
        return n

    @rule(seq=seqs)
    def insert(self, seq):
        if self.pool.available_size() < len(seq):
            self.evict(len(seq) - self.pool.available_size())
        slots = self.pool.alloc(len(seq))
        if slots is None:
            return
        cached = self._ref_match(seq)
        dup = self.cache.insert(list(seq), slots)
        assert dup == cached
        self.pool.free(slots[:dup])
        for i in range(dup, len(seq)):
            self.ref[tuple(seq[: i + 1])] = int(slots[i])

    @rule(seq=seqs)
    def match(self, seq):
        slots, node = self.cache.match_prefix(list(seq))
        n = self._ref_match(seq)
        assert len(slots) == n, "match must return the longest cached prefix"
        assert slots.tolist() == [self.ref[tuple(seq[: i + 1])] for i in range(n)]

    @rule(seq=seqs)
    def lock(self, seq):
        slots, node = self.cache.match_prefix(list(seq))
        if len(slots):
            self.cache.inc_lock_ref(node)
            self.locks.append((tuple(seq[: len(slots)]), node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        _, node = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(1, POOL))
    def evict(self, n):
        before = tree_content(self.cache)
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(n)
        after = tree_content(self.cache)
        assert freed == len(before) - len(after)
        assert freed >= min(n, evictable)
        assert set(after.items()) <= set(before.items())
        self.ref = after

    @rule()
    def flush(self):
        if self.cache.flush():
            assert not self.locks
            self.ref = {}
        else:
            assert self.locks

    @invariant()
    def consistent(self):
        content = tree_content(self.cache)
        assert content == self.ref
        assert self.cache.total_size() == len(content)
        free = self.pool.free_slots().tolist()
        assert len(free) + len(content) == POOL, "every slot is free or cached, never lost"
        assert set(free).isdisjoint(content.values()) and len(set(free)) == len(free)
        assert len(set(content.values())) == len(content), "no slot owned twice"
        locked = set()
        for prefix, _ in self.locks:
            assert all(prefix[: i + 1] in content for i in range(len(prefix))), "a locked path was evicted"
            locked |= {prefix[: i + 1] for i in range(len(prefix))}
        assert self.cache.protected_size() == len(locked)
        assert self.cache.evictable_size() == len(content) - len(locked)


TestRadixCache = RadixMachine.TestCase
TestRadixCache.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
