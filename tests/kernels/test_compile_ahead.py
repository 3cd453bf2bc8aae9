"""kernels._triton.compile_ahead: the skinny-matmul tuner compiles every candidate on several threads before it
times them (on a fresh GPU machine the 70B shape's candidates took 106 s one after another). The compiles
themselves need a GPU driver; here the seam is checked with a kernel object that records what it is asked: inside
`compile_ahead` a `launch` only compiles, outside it runs, and a config that fails is skipped, not fatal."""

from __future__ import annotations

import pytest

from radixlm.kernels import HAS_TRITON
from radixlm.kernels._triton import compile_ahead, launch

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


class Recorder:
    """Stands in for a @triton.jit function: `kernel[grid](...)` runs, `kernel.warmup(..., grid=...)` compiles."""

    def __init__(self):
        self.ran, self.compiled = [], []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.ran.append((grid, args, kw))

    def warmup(self, *args, grid, **kw):
        if kw.get("BLOCK") == 0:
            raise ValueError("cannot build BLOCK=0")
        self.compiled.append((grid, args, kw))


def test_launches_inside_only_compile_and_failures_are_skipped():
    k = Recorder()
    calls = [lambda b=b: launch(k, (4,), "x", BLOCK=b, num_warps=4) for b in (64, 0, 128)]
    made = compile_ahead(calls, workers=2)
    assert made is not None  # the pinned Triton has the asynchronous compile mode (else: compiles at first launch)
    assert made[0] == 2 and made[1] >= 0
    assert k.ran == []  # nothing ran
    assert k.compiled == [((4,), ("x",), {"BLOCK": 64, "num_warps": 4}), ((4,), ("x",), {"BLOCK": 128, "num_warps": 4})]
    launch(k, (8,), "y", BLOCK=32)  # outside: a real launch again
    assert k.ran == [((8,), ("y",), {"BLOCK": 32})] and len(k.compiled) == 2
