"""What a thread is blocked in, natively: for naming the lock or driver call a stalled scheduler thread waits in
on machines where the kernel's wait channel and stack read as nothing (the lent VMs). `pid` is "self" (the step
trace's watcher) or another process's id (benchmarks/gpu/stall_sampler.py, which needs ptrace rights over it).

While a thread is in a system call, /proc/PID/task/TID/syscall gives its stack pointer and program counter.
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
import functools
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

    def __init__(self, text: str | None = None, pid: int | str = "self"):
        text = text if text is not None else Path(f"/proc/{pid}/maps").read_text()
        rows = sorted((int(lo, 16), int(hi, 16), int(off, 16), os.path.basename(name) or "anon", name)
                      for lo, hi, off, name in _CODE.findall(text))
        self.starts = [r[0] for r in rows]
        self.rows = rows

    def find(self, addr: int) -> tuple[int, int, int, str, str] | None:
        """(start, end, file offset, file name, path) of the code mapping holding `addr`."""
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.rows[i] if i >= 0 and addr < self.rows[i][1] else None

    def where(self, addr: int) -> str:
        """`lib+0xoffset` (the offset in the file), or the raw address outside code."""
        row = self.find(addr)
        return f"{row[3]}+{addr - row[0] + row[2]:#x}" if row else f"{addr:#x}"


_code: dict = {}  # pid -> (key, CodeMap)
_mem_fds: dict = {}  # pid -> fd of /proc/PID/mem


def code_map(pid: int | str = "self") -> CodeMap:
    text = Path(f"/proc/{pid}/maps").read_text()
    key = "".join(m.group(0) for m in _CODE.finditer(text))
    cached = _code.get(pid)
    if cached is None or cached[0] != key:
        cached = _code[pid] = (key, CodeMap(text))
    return cached[1]


def cached_code_map(pid: int | str = "self") -> CodeMap:
    """The code map as last read (read now if never): fast, for use while a stall lasts."""
    cached = _code.get(pid)
    return cached[1] if cached is not None else code_map(pid)


def read_memory(addr: int, nbytes: int, pid: int | str = "self") -> bytes:
    """Up to `nbytes` of the process's memory at `addr`; b"" where nothing is mapped."""
    fd = _mem_fds.get(pid)
    if fd is None:
        fd = _mem_fds[pid] = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, addr)
    except (OSError, OverflowError):
        # a read running into an unmapped page fails whole: retry up to that page's end
        end = (addr | 0xFFF) + 1
        if end - addr >= nbytes:
            return b""
        try:
            return os.pread(fd, end - addr, addr)
        except (OSError, OverflowError):
            return b""


def syscall_registers(fields: list[str]) -> tuple[int, int] | None:
    """(stack pointer, program counter) from a /proc/.../syscall file's fields; None while the thread runs (the
    file says only "running")."""
    return (int(fields[-2], 16), int(fields[-1], 16)) if len(fields) > 2 else None


def registers(tid: int, pid: int | str = "self") -> tuple[int, int] | None:
    """(stack pointer, program counter) of a thread blocked in the kernel; None while it runs."""
    try:
        return syscall_registers(Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split())
    except OSError:
        return None


def stack_guess(tid: int, code: CodeMap, pid: int | str = "self", regs: tuple[int, int] | None = None) -> list[int]:
    """The thread's program counter and the code addresses found on its stack, innermost first, repeats
    folded; empty while the thread runs (unless `regs`, its stack pointer and program counter, are given)."""
    regs = regs or registers(tid, pid)
    if regs is None:
        return []
    sp, pc = regs
    frames = [pc]
    raw = read_memory(sp & ~7, SCAN_BYTES, pid)
    for (word,) in struct.iter_unpack("Q", raw[: len(raw) // 8 * 8]):
        if word != frames[-1] and code.find(word) is not None:
            frames.append(word)
            if len(frames) >= MAX_FRAMES:
                break
    return frames


def futex_owner(addr: int, tids: set[int], pid: int | str = "self") -> int | None:
    """The thread holding the pthread mutex whose lock word is at `addr` (glibc keeps the owner's id two ints
    on), if the word looks like a taken mutex and the owner is one of `tids`; None otherwise (a condition
    variable, a semaphore, the GIL's wait)."""
    raw = read_memory(addr, 12, pid)
    if len(raw) < 12:
        return None
    lock, _, owner = struct.unpack("iii", raw)
    return owner if lock != 0 and owner in tids else None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


@functools.cache
def _libc() -> ctypes.CDLL:
    """This process's C library, with the prototypes of the calls used here."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    libc.dladdr.restype = ctypes.c_int
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    return libc


def symbolize(addrs, code: CodeMap | None = None) -> dict[str, str]:
    """{hex address: `lib!symbol+0xoff` where an exported name is near, else `lib+0xoffset`} (dladdr: slow,
    takes the loader lock; for a quiet moment)."""
    code = code or code_map()
    dladdr = _libc().dladdr
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


def symbolize_foreign(addrs, maps_text: str) -> dict[str, str]:
    """Name another process's code addresses (its /proc/PID/maps text given): each library is mapped here too
    (the same file; loaded if it is not yet) and the address at the same file offset goes to dladdr."""
    addrs = list(addrs)
    theirs = CodeMap(maps_text)
    by_path: dict[str, list[int]] = {}
    for addr in addrs:
        row = theirs.find(addr)
        if row is not None and row[4].startswith("/"):
            by_path.setdefault(row[4], []).append(addr)
    ours = code_map()
    mine = {row[4] for row in ours.rows}
    for path in by_path:
        if path not in mine:
            try:
                ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
            except OSError:
                pass
    ours = code_map()
    here: dict[int, int] = {}  # their address -> ours
    for path, addrs_in in by_path.items():
        rows = [r for r in ours.rows if r[4] == path]
        for addr in addrs_in:
            lo, _, off, _, _ = theirs.find(addr)
            file_off = addr - lo + off
            for r in rows:
                if r[2] <= file_off < r[2] + (r[1] - r[0]):
                    here[addr] = r[0] + file_off - r[2]
    named = symbolize(here.values(), ours)
    out = {f"{a:#x}": theirs.where(a) for a in addrs}
    for theirs_addr, our_addr in here.items():
        name = named.get(f"{our_addr:#x}")
        if name is not None:
            out[f"{theirs_addr:#x}"] = name
    return out


_PTRACE_GETREGS, _PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 12, 17, 0x4206, 0x4207
_WALL = 0x40000000
_RIP, _RSP = 16, 19  # in x86-64's user_regs_struct (27 unsigned longs)


def interrupt_registers(tid: int) -> tuple[int, int] | None:
    """(stack pointer, program counter) of a thread of another process while it runs: attach with ptrace,
    stop it for the registers (tens of microseconds), let it go. None where ptrace is refused or not x86-64.
    The thread is attached only for this, so no signal of its waits on us afterwards."""
    if os.uname().machine != "x86_64":
        return None
    libc = _libc()
    if libc.ptrace(_PTRACE_SEIZE, tid, None, None) != 0:
        return None
    try:
        if libc.ptrace(_PTRACE_INTERRUPT, tid, None, None) != 0:
            return None
        os.waitpid(tid, _WALL)
        regs = (ctypes.c_ulong * 27)()
        if libc.ptrace(_PTRACE_GETREGS, tid, None, ctypes.byref(regs)) != 0:
            return None
        return regs[_RSP], regs[_RIP]
    except ChildProcessError:
        return None
    finally:
        libc.ptrace(_PTRACE_DETACH, tid, None, None)
