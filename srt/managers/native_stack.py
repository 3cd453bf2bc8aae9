"""What a thread of this process is blocked in, natively: for naming the lock or driver call a stalled scheduler
thread waits in on machines where the kernel's wait channel and stack read as nothing (the lent VMs).

While a thread is in a system call, /proc/self/task/TID/syscall gives its stack pointer and program counter.
The words just above the stack pointer that point into executable mappings are mostly return addresses: a
frame-pointer-free stack guess, the kind debuggers fall back on. A few are stale values, so read a guess as a
whole (a run of libcuda frames under a libtorch caller that names the CUDA call, or libpython's
PyEval_RestoreThread: waiting for the GIL). For a futex, the owner field of a pthread mutex at that address names
the thread that holds it, when that is one of ours.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

SCAN_BYTES = 8192  # of stack above the stack pointer: a few dozen frames
MAX_FRAMES = 20
NEAR_SYMBOL = 0x4000  # farther from the nearest exported name than this, the name says nothing (stripped code)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


_dladdr = None


def _resolve(addr: int) -> tuple[str, int] | None:
    """The nearest exported symbol at or below `addr` and the distance to it (dladdr)."""
    global _dladdr
    if _dladdr is None:
        _dladdr = ctypes.CDLL(None).dladdr
        _dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        _dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not _dladdr(addr, ctypes.byref(info)) or not info.dli_sname or not info.dli_saddr:
        return None
    return info.dli_sname.decode(errors="replace"), addr - info.dli_saddr


@dataclass
class Mappings:
    """This process's mappings (/proc/self/maps), searchable by address."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    perms: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, text: str | None = None) -> "Mappings":
        global _last
        text = text if text is not None else Path("/proc/self/maps").read_text()
        if _last is not None and _last[0] == text:  # parsed once while the mappings stay as they were
            return _last[1]
        m = cls()
        for line in text.splitlines():
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            m.starts.append(lo)
            m.ends.append(hi)
            m.perms.append(fields[1])
            m.offsets.append(int(fields[2], 16))
            m.names.append(os.path.basename(fields[5]) if len(fields) > 5 else "anon")
        _last = (text, m)
        return m

    def find(self, addr: int) -> int | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        return i if i >= 0 and addr < self.ends[i] else None

    def readable(self, addr: int, nbytes: int) -> int:
        """How many of `nbytes` from `addr` can be read (0 when `addr` is not in a readable mapping)."""
        i = self.find(addr)
        if i is None or self.perms[i][0] != "r":
            return 0
        return min(nbytes, self.ends[i] - addr)

    def symbol(self, addr: int) -> str | None:
        """`lib+0xoffset` (the offset in the file), `lib!symbol+0xoff` when an exported name is near; None when
        `addr` is not in executable code."""
        i = self.find(addr)
        if i is None or "x" not in self.perms[i]:
            return None
        name = self.names[i]
        near = _resolve(addr)
        if near is not None and near[1] < NEAR_SYMBOL:
            return f"{name}!{near[0][:90]}+{near[1]:#x}"
        return f"{name}+{addr - self.starts[i] + self.offsets[i]:#x}"


_last: tuple[str, Mappings] | None = None


def read_words(addr: int, count: int, maps: Mappings, fmt: str = "Q") -> tuple[int, ...]:
    """`count` words of this process's memory at `addr` (fewer where the mapping ends; none if unmapped)."""
    size = struct.calcsize(fmt)
    n = maps.readable(addr, count * size) // size
    return struct.unpack(f"{n}{fmt}", ctypes.string_at(addr, n * size)) if n else ()


def registers(tid: int) -> tuple[int, int] | None:
    """(stack pointer, program counter) of a thread of this process blocked in the kernel; None while it runs."""
    try:
        call = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
    except OSError:
        return None
    if len(call) < 3:  # "running"
        return None
    return int(call[-2], 16), int(call[-1], 16)


def stack_guess(tid: int, maps: Mappings) -> list[str]:
    """The thread's program counter and the code addresses found on its stack, innermost first, repeats
    folded; empty while the thread runs."""
    regs = registers(tid)
    if regs is None:
        return []
    sp, pc = regs
    frames = [maps.symbol(pc) or f"{pc:#x}"]
    for word in read_words(sp & ~7, SCAN_BYTES // 8, maps):
        name = maps.symbol(word)
        if name is not None and name != frames[-1]:
            frames.append(name)
            if len(frames) >= MAX_FRAMES:
                break
    return frames


def futex_owner(addr: int, tids: set[int], maps: Mappings) -> int | None:
    """The thread holding the pthread mutex whose lock word is at `addr` (glibc keeps the owner's id two ints
    on), if the word looks like a taken mutex and the owner is one of `tids`; None otherwise (a condition
    variable, a semaphore, the GIL's wait)."""
    words = read_words(addr, 3, maps, "i")
    if len(words) == 3 and words[0] != 0 and words[2] in tids:
        return words[2]
    return None
