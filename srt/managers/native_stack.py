"""What a thread of this process is blocked in, natively: for naming the lock or driver call a stalled scheduler
thread waits in on machines where the kernel's wait channel and stack read as nothing (the lent VMs).

While a thread is in a system call, /proc/self/task/TID/syscall gives its stack pointer and program counter.
The words just above the stack pointer that point into executable mappings are mostly return addresses: a
frame-pointer-free stack guess, the kind debuggers fall back on. A few are stale values, so read a guess as a
whole (a run of libcuda frames under a libtorch caller that names the CUDA call, or libpython's
PyEval_RestoreThread: waiting for the GIL). For a futex, the owner field of a pthread mutex at that address names
the thread that holds it, when that is one of ours.

Capture is cheap and takes no loader lock (it runs while the stalled phase lasts): raw addresses, memory read
through /proc/self/mem (an unmapped address is an error, not a crash). Naming them (`symbolize`, dladdr: a linear
scan of a library's symbols under the loader lock, about a millisecond each in libtorch) waits for a quiet moment.
"""
from __future__ import annotations

import bisect
import ctypes
import os
import re
import struct
from pathlib import Path

SCAN_BYTES = 8192  # of stack above the stack pointer: a few dozen frames
MAX_FRAMES = 20
NEAR_SYMBOL = 0x4000  # farther from the nearest exported name than this, the name says nothing (stripped code)

_CODE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) r-xp ([0-9a-f]+) \S+ \S+ *(.*)$", re.M)


class CodeMap:
    """This process's executable mappings, searchable by address (rebuilt when libraries come or go)."""

    def __init__(self, text: str | None = None):
        text = text if text is not None else Path("/proc/self/maps").read_text()
        rows = sorted((int(lo, 16), int(hi, 16), int(off, 16), os.path.basename(name) or "anon")
                      for lo, hi, off, name in _CODE.findall(text))
        self.starts = [r[0] for r in rows]
        self.rows = rows

    def find(self, addr: int) -> tuple[int, int, int, str] | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.rows[i] if i >= 0 and addr < self.rows[i][1] else None

    def where(self, addr: int) -> str:
        """`lib+0xoffset` (the offset in the file), or the raw address outside code."""
        row = self.find(addr)
        return f"{row[3]}+{addr - row[0] + row[2]:#x}" if row else f"{addr:#x}"


_code: CodeMap | None = None
_code_key: str | None = None
_mem_fd: int | None = None


def code_map() -> CodeMap:
    global _code, _code_key
    text = Path("/proc/self/maps").read_text()
    key = "".join(m.group(0) for m in _CODE.finditer(text))
    if key != _code_key:
        _code, _code_key = CodeMap(text), key
    return _code


def read_memory(addr: int, nbytes: int) -> bytes:
    """Up to `nbytes` of this process's memory at `addr`; b"" where nothing is mapped."""
    global _mem_fd
    if _mem_fd is None:
        _mem_fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        return os.pread(_mem_fd, nbytes, addr)
    except (OSError, OverflowError):
        # a read running into an unmapped page fails whole: retry up to that page's end
        end = (addr | 0xFFF) + 1
        if end - addr >= nbytes:
            return b""
        try:
            return os.pread(_mem_fd, end - addr, addr)
        except (OSError, OverflowError):
            return b""


def registers(tid: int) -> tuple[int, int] | None:
    """(stack pointer, program counter) of a thread of this process blocked in the kernel; None while it runs."""
    try:
        call = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
    except OSError:
        return None
    if len(call) < 3:  # "running"
        return None
    return int(call[-2], 16), int(call[-1], 16)


def stack_guess(tid: int, code: CodeMap) -> list[int]:
    """The thread's program counter and the code addresses found on its stack, innermost first, repeats
    folded; empty while the thread runs."""
    regs = registers(tid)
    if regs is None:
        return []
    sp, pc = regs
    frames = [pc]
    raw = read_memory(sp & ~7, SCAN_BYTES)
    for (word,) in struct.iter_unpack("Q", raw[: len(raw) // 8 * 8]):
        if word != frames[-1] and code.find(word) is not None:
            frames.append(word)
            if len(frames) >= MAX_FRAMES:
                break
    return frames


def futex_owner(addr: int, tids: set[int]) -> int | None:
    """The thread holding the pthread mutex whose lock word is at `addr` (glibc keeps the owner's id two ints
    on), if the word looks like a taken mutex and the owner is one of `tids`; None otherwise (a condition
    variable, a semaphore, the GIL's wait)."""
    raw = read_memory(addr, 12)
    if len(raw) < 12:
        return None
    lock, _, owner = struct.unpack("iii", raw)
    return owner if lock != 0 and owner in tids else None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def symbolize(addrs, code: CodeMap | None = None) -> dict[str, str]:
    """{hex address: `lib!symbol+0xoff` where an exported name is near, else `lib+0xoffset`} (dladdr: slow,
    takes the loader lock; for a quiet moment)."""
    code = code or code_map()
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    out = {}
    for addr in addrs:
        row = code.find(addr)
        if row is None:
            continue
        info = _DlInfo()
        if dladdr(addr, ctypes.byref(info)) and info.dli_sname and info.dli_saddr \
                and addr - info.dli_saddr < NEAR_SYMBOL:
            out[f"{addr:#x}"] = f"{row[3]}!{info.dli_sname.decode(errors='replace')[:90]}+{addr - info.dli_saddr:#x}"
        else:
            out[f"{addr:#x}"] = code.where(addr)
    return out
