"""The KV slot pool's free list: freed slots are kept apart until an allocation needs them (so a free costs what it
frees, not the pool's size); nothing is lost, handed out twice or changed by the caller after it was freed."""

from __future__ import annotations

import torch

from radixlm.srt.mem_cache import memory_pool
from radixlm.srt.mem_cache.memory_pool import TokenToKVPool

SIZE = 64


def _pool() -> TokenToKVPool:
    return TokenToKVPool(SIZE, 1, 1, 1, torch.float32, torch.device("cpu"))


def test_freed_slots_come_back_once_the_fresh_ones_run_out():
    pool = _pool()
    first = pool.alloc(SIZE - 4)
    head = pool._free
    pool.free(first[:10])
    assert pool._free is head, "a free does not copy the free list (it cost O(pool) per free)"
    assert pool.available_size() == 14
    assert pool.alloc(15) is None, "more than is free"
    rest = pool.alloc(14)  # 4 never used, then the 10 freed
    assert sorted(rest.tolist()) == sorted(list(range(SIZE - 3, SIZE + 1)) + first[:10].tolist())
    assert pool.available_size() == 0 and pool.alloc(1) is None


def test_a_freed_view_is_copied():
    pool = _pool()
    table = pool.alloc(8).clone()
    pool.free(table[2:5])  # a view of the caller's table, whose row is then reused for something else
    kept = table[2:5].tolist()
    table[:] = 0
    pool.alloc(SIZE - 8)
    assert pool.alloc(3).tolist() == kept


def test_many_small_frees_keep_every_slot(monkeypatch):
    monkeypatch.setattr(memory_pool, "_MAX_FREED_PIECES", 4)  # join the pieces often
    pool = _pool()
    slots = pool.alloc(SIZE)
    for s in slots.split(1):
        pool.free(s)
    assert len(pool._freed) < 4
    assert pool.available_size() == SIZE
    free = pool.free_slots().tolist()
    assert sorted(free) == list(range(1, SIZE + 1)), "each slot free exactly once"
    assert sorted(pool.alloc(SIZE).tolist()) == list(range(1, SIZE + 1))


def test_clear_drops_the_pending_frees():
    pool = _pool()
    pool.free(pool.alloc(5))
    pool.clear()
    assert pool.available_size() == SIZE
    assert sorted(pool.free_slots().tolist()) == list(range(1, SIZE + 1))
