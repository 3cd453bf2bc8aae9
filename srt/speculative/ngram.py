"""Draft tokens without a draft model: prompt lookup over a request's own tokens, and continuations that the
radix tree already holds.

`NgramIndex` follows one request's token sequence (prompt, then output) and remembers, for every n-gram of
`min_n..max_n` tokens, where its latest earlier occurrence ended. The draft for the next step is what followed
the longest n-gram that ends the sequence, the last time it occurred: a RAG answer quoting its document, a code
edit repeating the file, a JSON field copied from the prompt. Appending a token costs `max_n - min_n + 1` dict
writes; a lookup as many reads.
"""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("min_n", "max_n", "tokens", "ends", "epoch")

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> end (exclusive) of its latest occurrence that something followed (end < len(tokens))
        self.ends: dict[tuple[int, ...], int] = {}
        self.epoch = -1  # the request epoch the tokens belong to (see sync)

    def sync(self, tokens: list[int], epoch: int) -> None:
        """Follow the request's tokens. The sequence only grows within one epoch of the request; a retraction
        or a jump-forward (which may take tokens back) starts a new epoch, and the index is rebuilt."""
        if epoch != self.epoch or len(tokens) < len(self.tokens):
            self.tokens, self.ends, self.epoch = [], {}, epoch
        for t in tokens[len(self.tokens) :]:
            self._append(t)

    def _append(self, token: int) -> None:
        seq = self.tokens
        end = len(seq)
        # The n-grams ending here are now followed by `token`: record them before it joins the sequence, so that
        # a lookup of the sequence's own tail never finds itself.
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self.ends[tuple(seq[end - n : end])] = end
        seq.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest n-gram ending the sequence, at its latest earlier occurrence."""
        seq = self.tokens
        size = len(seq)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self.ends.get(tuple(seq[size - n :]))
            if end is not None:
                return seq[end : end + k]
        return []
