"""The branches of `state.fork(n)`, and how they come back (`join`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixlm.lang.backend.base import LangError

if TYPE_CHECKING:
    from radixlm.lang.interpreter import ProgramState


class ForkGroup(list):
    """A list of branch states. `forks += x` appends x to every branch; `forks += lambda i: ...` appends the
    function's value for branch i to branch i, and a list or tuple gives one item per branch (SGLang's meaning)."""

    def __init__(self, branches: list[ProgramState], parent: ProgramState):
        super().__init__(branches)
        self.parent = parent

    def __iadd__(self, item):
        if callable(item):
            for i, b in enumerate(self):
                b += item(i)
        elif isinstance(item, (list, tuple)):
            if len(item) != len(self):
                raise LangError(
                    f"forks += a list of {len(item)} items for {len(self)} branches (one item per "
                    "branch; to append the same items to every branch, join them with +)"
                )
            for b, x in zip(self, item):
                b += x
        else:
            for b in self:
                b += item
        return self

    def join(self, mode: str = "gather_variable") -> list[ProgramState]:
        """Wait for every branch. With "gather_variable", each variable the branches made becomes a list on
        the parent (branch order); with "concate_and_append", the text each branch added is appended to the
        parent, branch after branch."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise LangError(f"unknown join mode {mode!r} (gather_variable or concate_and_append)")
        for b in self:
            b.sync()
        self.parent._submit(_Join(list(self), mode))
        return list(self)


class _Join:
    """Runs in the parent's order of items, so the join lands after what the parent was given before it."""

    def __init__(self, branches: list[ProgramState], mode: str):
        self.branches, self.mode = branches, mode

    def run(self, parent: ProgramState, fill: Callable[[str], None]) -> None:
        if self.mode == "gather_variable":
            names = {n for b in self.branches for n in b._vars if n not in b._forked_vars}
            for n in sorted(names):
                parent._vars[n] = [b._vars.get(n) for b in self.branches]
        else:
            fill("".join(b._text[b._fork_pos :] for b in self.branches))
