"""The router's choices without processes: the prefix index (chained block names, LRU bound that evicts the
longest prompts first), and each policy's pick from given loads and indexes."""

from __future__ import annotations

import pytest

from radixlm.srt.router.policy import Policy, PolicyConfig
from radixlm.srt.router.prefix_index import BLOCK, PrefixIndex, block_names
from radixlm.srt.router.workers import KV_FULL, LoadReport, Worker

SYSTEM = "You are a careful assistant who answers in French. " * 20  # 1,020 characters: 15 whole blocks


def _workers(n: int, capacity: int = 1000) -> list[Worker]:
    return [Worker(f"http://w{i}", PrefixIndex(capacity)) for i in range(n)]


def test_block_names_name_whole_prefixes():
    a, b = block_names(SYSTEM + "Question one?"), block_names(SYSTEM + "Another question entirely?")
    assert len(a) == len(SYSTEM + "Question one?") // BLOCK
    assert a[:15] == b[:15]  # the shared system prompt
    assert block_names("x" + SYSTEM)[:15] != a[:15]  # a name covers everything before it, not one block
    assert block_names("short") == []


def test_index_matches_leading_blocks_and_evicts_longest_first():
    idx = PrefixIndex(capacity=20)
    long_prompt = block_names(SYSTEM + "z" * (10 * BLOCK))  # 25 blocks: more than the capacity
    idx.insert(long_prompt)
    assert len(idx) == 20
    assert idx.match(long_prompt) == 20  # the first 20 stayed: a prefix outlives what extends it
    assert idx.match(block_names(SYSTEM + "other")) == 15
    assert idx.match(block_names("unrelated " * 40)) == 0


def test_cache_aware_sends_a_prefix_where_it_was_sent_before():
    ws = _workers(3)
    policy = Policy(PolicyConfig("cache_aware"))
    first = policy.choose(ws, block_names(SYSTEM + "q1"), len(SYSTEM) + 2)
    again = policy.choose(ws, block_names(SYSTEM + "q2"), len(SYSTEM) + 2)
    assert again.worker is first.worker and again.matched > 0.9
    other = policy.choose(ws, block_names("A different system prompt. " * 40), 1080)
    assert other.worker is not first.worker  # a miss goes by load, and ties turn: not the same worker again


def test_cache_aware_leaves_an_overloaded_holder_and_avoids_a_full_kv_cache():
    ws = _workers(2)
    policy = Policy(PolicyConfig("cache_aware", balance_abs=1000, balance_rel=1.5))
    holder = policy.choose(ws, block_names(SYSTEM), len(SYSTEM)).worker
    other = ws[1] if holder is ws[0] else ws[0]
    holder.report = LoadReport(waiting_tokens=500, at=1.0)  # a little busier: the prefix wins
    assert policy.choose(ws, block_names(SYSTEM + "q"), len(SYSTEM) + 1).worker is holder
    holder.report = LoadReport(waiting_tokens=50_000, at=1.0)  # far busier than the other: the other gets it
    assert policy.choose(ws, block_names(SYSTEM + "q"), len(SYSTEM) + 1).worker is other
    assert other.index.match(block_names(SYSTEM)) == 15  # and is now believed to hold the prefix too
    other.report = LoadReport(kv_used=KV_FULL + 0.05, at=1.0)  # the other's KV cache is full: never there
    least = Policy(PolicyConfig("least_load"))
    assert all(least.choose(ws, [], 10).worker is holder for _ in range(3))


def test_least_load_counts_prompts_sent_since_the_last_report():
    from radixlm.srt.router.workers import WorkerSet

    ws = WorkerSet(["http://a", "http://b"], 100, 1.0)
    a, b = ws.workers.values()
    ws.opened(a, tokens=3000)  # the report predates it: the router's own estimate counts
    policy = Policy(PolicyConfig("least_load"))
    assert policy.choose(ws.healthy(), [], 10).worker is b


def test_round_robin_random_and_exclusions():
    ws = _workers(3)
    rr = Policy(PolicyConfig("round_robin"))
    assert [rr.choose(ws, [], 1).worker.url for _ in range(6)] == [w.url for w in ws] * 2
    rnd = Policy(PolicyConfig("random"), seed=1)
    assert len({rnd.choose(ws, [], 1).worker.url for _ in range(30)}) == 3
    assert rr.choose(ws, [], 1, exclude=frozenset({"http://w0", "http://w1"})).worker.url == "http://w2"
    with pytest.raises(LookupError):
        rr.choose(ws, [], 1, exclude=frozenset(w.url for w in ws))
    with pytest.raises(ValueError, match="unknown routing policy"):
        Policy(PolicyConfig("fastest"))
