"""Small process helpers shared by the server's processes."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path


def configure_logging(level: str, prefix: str = "") -> None:
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", force=True
    )


# Looked up once, on import: kill_on_parent_death may run between fork and exec (a Popen preexec_fn), where
# loading a library could wait forever on a lock some thread of the parent held when it forked.
_PRCTL = getattr(ctypes.CDLL(None), "prctl", None)  # Linux's; None elsewhere


def kill_on_parent_death() -> None:
    """SIGKILL this process when the one that started it dies (PR_SET_PDEATHSIG; nothing where there is no prctl).
    Safe as a Popen preexec_fn."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)


def die_with_parent() -> None:
    """Children of the server get SIGKILL if the launching process dies, so no orphan outlives it; they ignore
    SIGINT (a terminal's Ctrl-C reaches the whole group) and leave shutdown to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm otherwise creates a multiprocessing lock (a named semaphore) that a terminated child leaves behind.
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    kill_on_parent_death()


def freeze_startup_objects() -> None:
    """Move everything alive now (model, tokenizer, app, imports: all of it lives as long as the process) out of
    the cyclic collector's reach. Its full passes would otherwise walk it mid-serving and hold up a step, or
    every stream's next chunk, for as long as the walk takes."""
    gc.collect()
    gc.freeze()


def read_proc_stat(path: str) -> tuple[str, list[str]]:
    """(command name, the fields after it) of a /proc/.../stat file. The name may hold spaces and parentheses,
    so it ends at the last ")". fields[0] is the state (stat's field 3), fields[36] the CPU it last ran on
    (field 39). OSError once the process or thread is gone."""
    stat = Path(path).read_text()
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def to_device(host, device):
    """A host tensor onto `device`; on CUDA without stalling the host (through pinned memory allocated once:
    model_executor/host_transfer.py says why)."""
    if getattr(device, "type", device) == "cuda":
        from radixlm.srt.model_executor.host_transfer import upload

        return upload(host, device)
    return host.to(device)


@contextlib.contextmanager
def exclusive(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) across processes: work that several processes
    starting together would otherwise all do at once (a JIT build, a download) is done by one while the others
    wait, then find its result. The kernel drops the lock if the holder dies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
