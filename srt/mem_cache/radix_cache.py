"""RadixAttention's prefix cache: a radix tree over token ids whose nodes own the KV slots of their tokens.

Ownership: every KV slot is in exactly one of {the pool's free list, a tree node, a running request's private
tail}. A running request holds a lock on the node ending its shared prefix; a locked node and its ancestors are
never evicted. Eviction frees least-recently-used unlocked leaves, found through a lazily-updated heap.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from radixlm.srt.mem_cache.memory_pool import TokenToKVPool

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "removed")
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None"):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value  # int64 KV slots on the host, one per token of `key`
        self.lock_ref = 0
        self.last_access = time.monotonic()
        self.id = next(TreeNode._ids)
        self.removed = False


def _common_len(a: list[int], b: list[int], start: int = 0) -> int:
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, kv_pool: TokenToKVPool):
        self.kv_pool = kv_pool
        self.reset()

    # --- core tree operations --------------------------------------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._heap: list[tuple[float, int, TreeNode]] = []
        self.evicted_tokens = 0

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `key`: (its KV slots, the node ending exactly there)."""
        node, pos, parts = self.root, 0, []
        now = time.monotonic()
        node.last_access = now
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            pos += n
            node = child
        self._push_if_evictable(node)
        return (torch.cat(parts) if parts else _EMPTY), node

    def continuation(self, key: list[int], k: int) -> list[int]:
        """Up to k tokens the tree holds right after the whole of `key` (another request's prompt or answer that
        went on from there), following the most recently used branch; [] when `key` is not cached in full. Reads
        only: no split, no access time touched (speculative drafts must not keep entries alive)."""
        node, pos, out = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                return []
            size = len(child.key)
            if key[pos : pos + size] == child.key:  # the common case, compared in C
                pos, node = pos + size, child
                continue
            n = _common_len(child.key, key, pos)
            if pos + n < len(key):
                return []
            out, node = child.key[n : n + k], child  # `key` ends inside this node: its rest, then its children
            break
        while len(out) < k and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out += node.key[: k - len(out)]
        return out

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add `key` with its slots. Returns how many leading tokens were already cached: the caller still owns
        those slots of `value` (duplicates) and must free them."""
        node, pos = self.root, 0
        now = time.monotonic()
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], value[pos:].clone(), node)
                node.children[key[pos]] = leaf
                self._evictable += len(leaf.key)
                self._push_if_evictable(leaf)
                return pos
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        self._push_if_evictable(node)
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after its first n tokens; returns the new upper node (same lock count as `child`)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "radix lock released twice"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                self._push_if_evictable(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from LRU unlocked leaves if possible; returns how many were freed."""
        freed = 0
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if node.removed or node.children or node.lock_ref or stamp != node.last_access:
                continue  # a stale heap entry
            self.kv_pool.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            node.removed = True
            parent = node.parent
            del parent.children[node.key[0]]
            self._push_if_evictable(parent)
        self.evicted_tokens += freed
        if len(self._heap) > 4 * (self._evictable + 64):
            self._heap = [e for e in self._heap if not e[2].removed]
            heapq.heapify(self._heap)
        return freed

    def _push_if_evictable(self, node: TreeNode) -> None:
        if node is not self.root and not node.children and node.lock_ref == 0:
            heapq.heappush(self._heap, (node.last_access, node.id, node))

    def flush(self) -> bool:
        """Drop every unlocked entry. Returns False (and does nothing) while any request holds a lock."""
        if self._protected:
            return False
        self.evict(self._evictable)
        return True

    # --- sizes ---------------------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # --- request lifecycle -----------------------------------------------------------------------------------
    def match_req(self, req, limit: int | None = None) -> None:
        """Point `req` at its longest cached prefix (at most `limit` tokens) and lock it."""
        key = req.fill_ids[: limit if limit is not None else len(req.fill_ids)]
        slots, node = self.match_prefix(key)
        req.prefix_slots, req.last_node = slots, node
        self.inc_lock_ref(node)

    def cache_unfinished_req(self, req, slots: torch.Tensor) -> None:
        """After an extend: publish the computed tokens so others can share them, and re-lock the longer path.
        `slots` are the request's KV slots for fill_ids[:req.kv_len]."""
        key = req.fill_ids[: req.kv_len]
        owned = len(req.prefix_slots)
        dup = self.insert(key, slots)
        self.kv_pool.free(slots[owned:dup])
        new_slots, node = self.match_prefix(key)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        req.prefix_slots, req.last_node = new_slots, node

    def cache_finished_req(self, req, slots: torch.Tensor) -> None:
        """On finish or abort: hand every computed slot to the tree (or free duplicates) and drop the lock."""
        key = req.fill_ids[: req.kv_len]
        owned = len(req.prefix_slots)
        dup = self.insert(key, slots)
        self.kv_pool.free(slots[owned:dup])
        self.dec_lock_ref(req.last_node)
        req.prefix_slots, req.last_node = _EMPTY, None


class ChunkCache:
    """`--disable-radix-cache`: the same interface, no sharing across requests."""

    evicted_tokens = 0

    def __init__(self, kv_pool: TokenToKVPool):
        self.kv_pool = kv_pool

    def reset(self) -> None:
        pass

    def match_req(self, req, limit: int | None = None) -> None:
        req.prefix_slots, req.last_node = _EMPTY, None

    def cache_unfinished_req(self, req, slots: torch.Tensor) -> None:
        req.prefix_slots = slots  # the request keeps its own slots across chunks

    def cache_finished_req(self, req, slots: torch.Tensor) -> None:
        self.kv_pool.free(slots)
        req.prefix_slots, req.last_node = _EMPTY, None

    def evict(self, num_tokens: int) -> int:
        return 0

    def continuation(self, key: list[int], k: int) -> list[int]:
        return []

    def flush(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0
