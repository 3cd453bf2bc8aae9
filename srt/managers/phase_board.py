"""The scheduler's current phase in a small shared file, for an observer in another process.

RADIXLM_PHASE_BOARD=path: the scheduler writes its process and thread ids once, then at each phase it enters a
sequence number, the phase and the CLOCK_MONOTONIC time it began (an mmap write, well under a microsecond).
benchmarks/gpu/stall_sampler.py reads it to catch a phase that runs long and look at the scheduler thread from
outside while it lasts: unlike the step trace's watcher it takes no GIL in the scheduler, so it cannot be the
cause of what it measures. With the board on, any process of the same user may read the scheduler's memory.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import time

PHASES = (None, "schedule", "forward", "sample", "process")
_HEAD = struct.Struct("<qq")  # pid, tid
_SEQ = struct.Struct("<q")  # odd while the fields below are being written (a seqlock)
_CUR = struct.Struct("<qq")  # phase index, start (ns, CLOCK_MONOTONIC)
SIZE = _HEAD.size + _SEQ.size + _CUR.size


class PhaseBoard:
    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self.mem = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HEAD.pack_into(self.mem, 0, os.getpid(), threading.get_native_id())
        self.seq = 0
        _allow_observers()

    @classmethod
    def from_env(cls) -> "PhaseBoard | None":
        path = os.environ.get("RADIXLM_PHASE_BOARD")
        return cls(path) if path else None

    def enter(self, name: str | None) -> None:
        _SEQ.pack_into(self.mem, _HEAD.size, self.seq + 1)
        _CUR.pack_into(self.mem, _HEAD.size + _SEQ.size, PHASES.index(name), time.monotonic_ns())
        self.seq += 2
        _SEQ.pack_into(self.mem, _HEAD.size, self.seq)


def _allow_observers() -> None:
    """Let a process that is not our ancestor read our memory (the sampler reads the scheduler thread's stack
    through /proc/PID/mem), where Yama's ptrace_scope 1 would refuse it: opt-in, with the board only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1 % 2**64), 0, 0, 0)  # PR_SET_PTRACER, ANY
    except (OSError, AttributeError):
        pass


def read_board(mem) -> tuple[int, int, int, str | None, int]:
    """(pid, tid, sequence, phase, start ns) as last written."""
    pid, tid = _HEAD.unpack_from(mem, 0)
    while True:
        (seq,) = _SEQ.unpack_from(mem, _HEAD.size)
        phase, start = _CUR.unpack_from(mem, _HEAD.size + _SEQ.size)
        if seq % 2 == 0 and _SEQ.unpack_from(mem, _HEAD.size)[0] == seq:  # not torn by a write meanwhile
            return pid, tid, seq, PHASES[phase], start
