"""Order of the waiting queue: lpm (longest cached prefix first), dfs-weight, fcfs, lof, random."""

from __future__ import annotations

import random
from collections import defaultdict

from radixlm.srt.mem_cache.radix_cache import RadixCache
from radixlm.srt.scheduler.req import Req

# Matching every waiting request against the tree costs time proportional to the queue; past this length
# prefix-aware policies fall back to arrival order, as the cache benefit no longer pays for the scan.
_PREFIX_POLICY_MAX_QUEUE = 128


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache, seed: int = 0):
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)

    def order(self, waiting: list[Req]) -> list[Req]:
        policy = self.policy
        prefix_aware = policy in ("lpm", "dfs-weight")
        if prefix_aware and (not isinstance(self.tree_cache, RadixCache) or len(waiting) > _PREFIX_POLICY_MAX_QUEUE):
            policy = "fcfs"
        if policy == "fcfs":
            return list(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda r: -r.max_new_tokens)
        if policy == "random":
            out = list(waiting)
            self.rng.shuffle(out)
            return out
        matched = {}
        nodes = {}
        for r in waiting:
            slots, node = self.tree_cache.match_prefix(r.fill_ids)
            matched[id(r)] = len(slots)
            nodes[id(r)] = node
        if policy == "lpm":
            return sorted(waiting, key=lambda r: -matched[id(r)])
        return self._dfs_weight(waiting, nodes)

    def _dfs_weight(self, waiting: list[Req], nodes: dict) -> list[Req]:
        """Visit the tree depth-first, heavier subtrees (more waiting requests below) first, so requests that
        share a prefix run back to back while it is still cached."""
        by_node = defaultdict(list)
        for r in waiting:
            by_node[nodes[id(r)]].append(r)
        weight = defaultdict(int)
        for node, reqs in by_node.items():
            n = node
            while n is not None:
                weight[n] += len(reqs)
                n = n.parent
        out: list[Req] = []
        stack = [self.tree_cache.root]
        while stack:
            node = stack.pop()
            out.extend(by_node.get(node, ()))
            children = [c for c in node.children.values() if weight[c] > 0]
            stack.extend(sorted(children, key=lambda c: weight[c]))  # heaviest popped first
        return out
