"""Keeps a latency-critical loop off CPUs that something else takes time from.

On some virtual machines one or two CPUs lose a large share of their time to interrupts and softirqs (network
and block devices are often bound to CPU 0 or 1). The kernel does not count that time as load, so a busy loop
may well sit there, and then it loses the CPU several milliseconds at a time. `CpuGuard` reads each CPU's
interrupt, softirq and steal time from /proc/stat every CHECK_S. When the CPU the calling thread runs on lost
more than HOT of the last window, it restricts the thread to the CPUs that lost less than QUIET (out of those it
was allowed at the start). The thresholds are low because the loss comes in bursts: a loop on a CPU losing about
10% on average can still stall 5-10 ms at a time, while quiet CPUs lose 0-1%. This removes one cause of host
stalls, not all; on by default because it lowered the c32 tail where measured (benchmarks/results/README.md).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from radixlm.srt.utils import read_proc_stat

logger = logging.getLogger(__name__)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_list(spec: str) -> set[int]:
    """ "0-3,8" -> {0, 1, 2, 3, 8} (the kernel's cpulist format); ValueError when malformed."""
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


def _read_proc_stat() -> str:
    return Path("/proc/stat").read_text()


def read_lost_ticks(read_stat=_read_proc_stat) -> dict[int, tuple[int, int]]:
    """lost_ticks of /proc/stat as `read_stat` gives it now; {} where it cannot be read."""
    try:
        return lost_ticks(read_stat())
    except OSError:
        return {}


def current_cpu() -> int | None:
    """The CPU the calling thread last ran on (field 39 of its stat)."""
    try:
        return int(read_proc_stat("/proc/thread-self/stat")[1][36])
    except (OSError, ValueError, IndexError):
        return None


class CpuGuard:
    """Call `tick()` from the loop; at most once per CHECK_S it reads /proc/stat and may move the thread.
    `since` (a `sample()` taken earlier, e.g. when the process started) makes the first window that long and
    the first tick check at once."""

    CHECK_S = 2.0  # /proc/stat counts in 10 ms ticks: a 2 s window tells 1.5% from 3%
    HOT = 0.03  # share of a window lost on the thread's CPU that makes it move
    QUIET = 0.015  # share a CPU may lose and still be one it moves to

    def __init__(
        self,
        label: str,
        read_stat=_read_proc_stat,
        where=current_cpu,
        set_affinity=os.sched_setaffinity,
        since: dict[int, tuple[int, int]] | None = None,
    ):
        self.label = label
        self._read, self._where, self._set = read_stat, where, set_affinity
        self.allowed = os.sched_getaffinity(0)  # what the operator gave the process (taskset, cgroup)
        self.moves: list[tuple[int, float, list[int]]] = []  # (from CPU, its lost share, CPUs moved to)
        self.last_check: dict = {}  # the CPU it ran on at the last check, the share that CPU lost, hot CPUs
        self._last = since if since else self.sample()
        self._due = 0.0 if since else time.monotonic() + self.CHECK_S

    def sample(self) -> dict[int, tuple[int, int]]:
        return read_lost_ticks(self._read)

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.CHECK_S
        cur, last = self.sample(), self._last
        shares = {
            c: (lost - last[c][0]) / max(total - last[c][1], 1)
            for c, (lost, total) in cur.items()
            if c in last and c in self.allowed
        }
        self._last = cur
        here = self._where()
        self.last_check = {
            "cpu": here,
            "lost": round(shares.get(here, 0.0), 4) if here is not None else None,
            "hot_cpus": sorted(c for c, share in shares.items() if share > self.HOT),
        }
        if here is None or shares.get(here, 0.0) <= self.HOT:
            return
        window = (cur[here][1] - last[here][1]) / _TICKS_PER_S
        quiet = sorted(c for c, share in shares.items() if share < self.QUIET and c != here)
        if not quiet:
            return
        self._set(0, quiet)  # 0: the calling thread (the loop's), not the process's other threads
        self.moves.append((here, round(shares[here], 3), quiet))
        logger.info(
            "%s moved off CPU %d (%.1f%% of the last %.0f s went to interrupts, softirqs or the hypervisor) to CPUs %s",
            self.label,
            here,
            100 * shares[here],
            window,
            _ranges(quiet),
        )

    def state(self) -> dict:
        """For /get_server_info: where the loop is allowed and was last seen, and every move so far."""
        return {
            "allowed_now": _ranges(sorted(os.sched_getaffinity(0))),
            **self.last_check,
            "moves": [{"from": c, "lost": share, "to": _ranges(to)} for c, share, to in self.moves],
        }

    async def run_in_loop(self) -> None:
        """An asyncio task that ticks every CHECK_S (an event loop has no step to tick from)."""
        import asyncio

        while True:
            await asyncio.sleep(self.CHECK_S)
            self.tick()


def guard_wanted(scheduler_cpus: str, device: str) -> bool:
    """Whether the server's loops guard their CPUs: `--scheduler-cpus auto` on a CUDA device (on a CPU device
    the forward's own threads use every core and placement is theirs). `device`: as given ("auto" asks torch)
    or as resolved ("cuda:0")."""
    if scheduler_cpus != "auto":
        return False
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def _ranges(cpus: list[int]) -> str:
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(parts)
