"""What the router believes each worker has cached: an approximate prefix tree of the prompts it sent there.

Prompts are cut into blocks of BLOCK characters and each block is named by a hash of itself and every block
before it (a chain), so a name stands for one whole prefix: a trie with block-sized edges, stored as a set of
names. The longest cached prefix of a prompt is the run of its leading names present in a worker's set. Each set
is bounded (least recently used names go first); a prompt's names are refreshed from its last block back to its
first, so a prefix is never evicted before a longer prompt that contains it.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 64  # characters per block: about 16 tokens of English text


def block_names(text: str) -> list[int]:
    """The chain of names of `text`'s whole blocks (a trailing partial block has none)."""
    names, prev = [], 0
    for i in range(0, len(text) - BLOCK + 1, BLOCK):
        prev = hash((prev, text[i : i + BLOCK]))
        names.append(prev)
    return names


class PrefixIndex:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.names: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.names)

    def match(self, names: list[int]) -> int:
        """How many leading blocks of a prompt with these names this worker is believed to hold."""
        n = 0
        for name in names:
            if name not in self.names:
                break
            n += 1
        return n

    def insert(self, names: list[int]) -> None:
        for name in reversed(names):
            self.names[name] = None
            self.names.move_to_end(name)
        while len(self.names) > self.capacity:
            self.names.popitem(last=False)

    def clear(self) -> None:
        self.names.clear()
