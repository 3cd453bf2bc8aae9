"""`srt.utils.exclusive`, the cross-process lock that makes processes starting together take turns at a JIT
build (FlashInfer's kernels) or the default model's download: while one process holds it another cannot take
it, it is free again once released, and the kernel frees it when its holder dies."""

from __future__ import annotations

import fcntl
import multiprocessing as mp

import pytest

from radixlm.srt.utils import exclusive


def _try_lock(path) -> bool:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def _hold(path, held, release, die: bool) -> None:
    from radixlm.srt.utils import kill_on_parent_death

    kill_on_parent_death()
    with exclusive(path):
        held.set()
        release.wait(60)
        if die:
            import os

            os._exit(3)  # the kernel must drop the lock with the process


@pytest.mark.parametrize("die", [False, True])
def test_one_holder_at_a_time_and_freed_when_released_or_dead(tmp_path, die):
    path = tmp_path / "locks" / "build.lock"  # its folder does not exist yet
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(path, held, release, die))
    p.start()
    try:
        assert held.wait(60)
        assert not _try_lock(path)  # another process holds it
        release.set()
        p.join(60)
        assert p.exitcode == (3 if die else 0)
        assert _try_lock(path)
        with exclusive(path):  # and this process can hold it in turn
            assert path.is_file()
    finally:
        if p.is_alive():
            p.kill()
