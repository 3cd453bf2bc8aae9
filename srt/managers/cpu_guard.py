"""Keeps a latency-critical loop off CPUs that something else takes time from.

On the lent H100 VMs, CPU 0 (sometimes CPU 1 or 2 as well) spent 11-34% of its time in softirqs. The kernel
does not count that time as load, so it readily places a busy thread there, and then takes the CPU from the
thread several milliseconds at a time. A scheduler loop stuck there stalled decode steps by 5-15 ms, which
tripled the p99 inter-token latency at concurrency 32. `CpuGuard` reads each CPU's interrupt, softirq and steal
time from /proc/stat once a second and, when the CPU the calling thread runs on lost more than HOT of the last
window, restricts the thread to the CPUs that lost less than QUIET (from those it was allowed at the start).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def cpu_list(spec: str) -> set[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8} (the kernel's cpulist format); ValueError when malformed."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        first, last = int(lo), int(hi if dash else lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(first, last + 1))
    return out


def lost_ticks(stat: str) -> dict[int, tuple[int, int]]:
    """cpu -> (ticks lost to irq + softirq + steal, all ticks) from the text of /proc/stat."""
    out = {}
    for line in stat.splitlines():
        f = line.split()
        if f and f[0].startswith("cpu") and f[0] != "cpu":
            ticks = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
            out[int(f[0][3:])] = (ticks[5] + ticks[6] + ticks[7], sum(ticks))
    return out


def current_cpu() -> int | None:
    """The CPU the calling thread last ran on (field 39 of its stat)."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[36])
    except (OSError, ValueError, IndexError):
        return None


class CpuGuard:
    """Call `tick()` from the loop; at most once per CHECK_S it reads /proc/stat and may move the thread."""

    CHECK_S = 1.0
    HOT = 0.05  # share of a window lost on the thread's CPU that makes it move
    QUIET = 0.02  # share a CPU may lose and still be one it moves to

    def __init__(self, label: str, read_stat=lambda: Path("/proc/stat").read_text(), where=current_cpu,
                 set_affinity=os.sched_setaffinity):
        self.label = label
        self._read, self._where, self._set = read_stat, where, set_affinity
        self.allowed = os.sched_getaffinity(0)  # what the operator gave the process (taskset, cgroup)
        self.moves: list[tuple[int, float, list[int]]] = []  # (from CPU, its lost share, CPUs moved to)
        self._last = self._sample()
        self._due = time.monotonic() + self.CHECK_S

    def _sample(self) -> dict[int, tuple[int, int]]:
        try:
            return lost_ticks(self._read())
        except OSError:
            return {}

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.CHECK_S
        cur = self._sample()
        shares = {c: (lost - self._last[c][0]) / max(total - self._last[c][1], 1)
                  for c, (lost, total) in cur.items() if c in self._last and c in self.allowed}
        self._last = cur
        here = self._where()
        if here is None or shares.get(here, 0.0) <= self.HOT:
            return
        quiet = sorted(c for c, share in shares.items() if share < self.QUIET and c != here)
        if not quiet:
            return
        self._set(0, quiet)  # 0: the calling thread (the loop's), not the process's other threads
        self.moves.append((here, round(shares[here], 3), quiet))
        logger.info("%s moved off CPU %d (%.0f%% of the last second went to interrupts, softirqs or the "
                    "hypervisor) to CPUs %s", self.label, here, 100 * shares[here], _ranges(quiet))


def _ranges(cpus: list[int]) -> str:
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(parts)
