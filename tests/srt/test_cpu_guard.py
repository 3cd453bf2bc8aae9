"""The scheduler loop's CPU guard: moving off CPUs that interrupts, softirqs or the hypervisor take time from."""

from __future__ import annotations

import os
import threading

import pytest

from radixlm.srt.cpu_guard import CpuGuard, cpu_list, current_cpu, lost_ticks
from radixlm.srt.server_args import ServerArgs


def _stat(rows: dict[int, tuple[int, int, int, int]]) -> str:
    """/proc/stat text with, per CPU, (user, idle, softirq, steal) ticks (irq, nice, system, iowait zero)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, (user, idle, soft, steal) in rows.items():
        lines.append(f"cpu{cpu} {user} 0 0 {idle} 0 0 {soft} {steal} 0 0")
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"


class FakeHost:
    def __init__(self, allowed: set[int], here: int):
        self.ticks = {c: [0, 0, 0, 0] for c in allowed}
        self.here = here
        self.calls: list[tuple[int, list[int]]] = []

    def spend(self, cpu: int, user=0, idle=0, soft=0, steal=0) -> None:
        t = self.ticks[cpu]
        t[0] += user
        t[1] += idle
        t[2] += soft
        t[3] += steal

    def guard(self) -> CpuGuard:
        g = CpuGuard(
            "test",
            read_stat=lambda: _stat(self.ticks),
            where=lambda: self.here,
            set_affinity=lambda pid, cpus: self.calls.append((pid, list(cpus))),
        )
        g.allowed = set(self.ticks)
        g._due = 0.0  # every tick checks
        return g


def test_cpu_list_reads_the_kernel_format_and_refuses_the_rest():
    assert cpu_list("0-3,8") == {0, 1, 2, 3, 8} and cpu_list("5") == {5} and cpu_list(" 1 , 3-4") == {1, 3, 4}
    for bad in ("", "a", "3-1", "-2", "1-"):
        with pytest.raises(ValueError):
            cpu_list(bad)


def test_lost_ticks_counts_irq_softirq_and_steal_per_cpu():
    text = "cpu  9 9 9 9 9 9 9 9\ncpu0 10 1 2 100 3 4 5 6 0 0\ncpu12 1 0 0 1 0 0 0 0\nintr 5\n"
    assert lost_ticks(text) == {0: (4 + 5 + 6, 131), 12: (0, 2)}


def test_guard_moves_the_loop_off_a_cpu_that_softirqs_take_time_from():
    host = FakeHost({0, 1, 2, 3}, here=0)
    g = host.guard()
    host.spend(0, user=70, soft=30)  # CPU 0 lost 30% of the second to softirqs
    host.spend(1, idle=100)
    host.spend(2, idle=98, steal=2)  # 2% stolen: too busy to move to
    host.spend(3, user=50, idle=49, soft=1)  # 1%: quiet enough
    g.tick()
    assert host.calls == [(0, [1, 3])]
    assert g.moves == [(0, 0.3, [1, 3])]
    state = g.state()
    assert state["cpu"] == 0 and state["lost"] == 0.3 and state["hot_cpus"] == [0]
    assert state["moves"] == [{"from": 0, "lost": 0.3, "to": "1,3"}]


def test_guard_stays_put_on_a_quiet_cpu_and_with_nowhere_quieter_to_go():
    host = FakeHost({0, 1}, here=1)
    g = host.guard()
    host.spend(0, soft=50, idle=50)
    host.spend(1, user=98, soft=2)  # under the 3% that makes it move
    g.tick()
    assert host.calls == []
    host.spend(1, user=90, soft=10)  # now hot, but CPU 0 is hotter still: no quiet CPU to go to
    host.spend(0, soft=50, idle=50)
    g.tick()
    assert host.calls == [] and g.moves == []


def test_guard_reads_at_most_once_per_interval():
    host = FakeHost({0, 1}, here=0)
    reads = []
    g = CpuGuard(
        "test", read_stat=lambda: reads.append(1) or _stat(host.ticks), where=lambda: 0, set_affinity=lambda *a: None
    )
    assert len(reads) == 1  # the first window starts at construction
    for _ in range(1000):
        g.tick()
    assert len(reads) == 1  # the loop calls tick() every iteration; /proc/stat is read every CHECK_S


def test_guard_with_an_earlier_sample_checks_that_window_at_the_first_tick():
    host = FakeHost({0, 1}, here=0)
    since = lost_ticks(_stat(host.ticks))  # taken as the process started
    host.spend(0, user=800, soft=200)  # model loading: CPU 0 lost 20%
    host.spend(1, idle=1000)
    g = CpuGuard(
        "test",
        read_stat=lambda: _stat(host.ticks),
        where=lambda: 0,
        set_affinity=lambda pid, cpus: host.calls.append((pid, list(cpus))),
        since=since,
    )
    g.allowed = {0, 1}
    g.tick()
    assert host.calls == [(0, [1])] and g.moves == [(0, 0.2, [1])]


def test_guard_moves_a_real_thread_and_only_that_thread():
    """With the real /proc and sched_setaffinity: the guard's thread ends up on the CPUs it chose, the rest of
    the process keeps its CPUs."""
    allowed = os.sched_getaffinity(0)
    got: dict = {}

    def loop_thread():
        here = current_cpu()
        got["here"] = here
        g = CpuGuard("test", where=lambda: here)
        g.HOT = -1.0  # treat wherever it runs as hot, and every other CPU as quiet
        g.QUIET = 2.0
        g._due = 0.0
        g.tick()
        got["moves"], got["after"] = g.moves, os.sched_getaffinity(0)

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    assert got["here"] in allowed
    others = sorted(allowed - {got["here"]})
    if others:
        assert got["moves"] == [(got["here"], got["moves"][0][1], others)] and got["after"] == set(others)
    else:  # a single CPU: nowhere to go
        assert got["moves"] == [] and got["after"] == allowed
    assert os.sched_getaffinity(0) == allowed


def test_server_args_check_scheduler_cpus():
    assert ServerArgs(scheduler_cpus="auto").scheduler_cpus == "auto"
    assert ServerArgs(scheduler_cpus="none").scheduler_cpus == "none"
    first = min(os.sched_getaffinity(0))
    assert ServerArgs(scheduler_cpus=str(first)).scheduler_cpus == str(first)
    with pytest.raises(ValueError, match="CPU list"):
        ServerArgs(scheduler_cpus="fast")
    with pytest.raises(ValueError, match="may not use"):
        ServerArgs(scheduler_cpus="100000")


def test_guard_is_wanted_on_cuda_with_auto_only():
    import torch

    from radixlm.srt.cpu_guard import guard_wanted

    assert guard_wanted("auto", "cuda") and guard_wanted("auto", "cuda:1")
    assert not guard_wanted("auto", "cpu") and not guard_wanted("none", "cuda") and not guard_wanted("3", "cuda")
    assert guard_wanted("auto", "auto") == torch.cuda.is_available()


def test_guard_ticks_from_an_event_loop():
    """An asyncio loop (the HTTP server's, the benchmark client's) runs the guard as a task."""
    import asyncio

    host = FakeHost({0, 1}, here=0)
    g = host.guard()
    g.CHECK_S = 0.01
    host.spend(0, user=50, soft=50)
    host.spend(1, idle=100)

    async def main():
        task = asyncio.create_task(g.run_in_loop())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if g.moves:
                break
        task.cancel()

    asyncio.run(main())
    assert g.moves == [(0, 0.5, [1])]
