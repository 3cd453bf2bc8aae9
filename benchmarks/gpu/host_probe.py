"""Is the host quiet? Samples the machine's CPU accounting while a benchmark runs, so that a latency tail can be
put down to our processes or to the machine (steal time from a busy hypervisor, other processes' load).

    python benchmarks/gpu/host_probe.py SERVER_PID OUT.json &   # ... run the workload ...; kill -INT $!

It wakes every millisecond and notes each of its own wake-ups more than 3 ms late (when the machine or the
container, not only our processes, held it back). Every 0.25 s it reads /proc/stat (user, system, iowait, steal,
idle across all CPUs); at the start and the end: the CPU cgroup's throttling counters and the CPU pressure; for
the server's process tree (each thread too) and every other process, CPU ticks, context switches (involuntary:
runnable but put off the CPU) and moves between CPUs; the kernel's memory events (NUMA hinting faults and
migrations, compaction); each CPU's interrupt, softirq and steal time, and the interrupts and softirqs that fired
on the CPUs where the server's busy threads ran. On SIGINT it writes a summary: the machine's kernel settings
(NUMA, huge pages), its busy and steal shares (mean and the worst interval), throttling, memory events, the CPUs
most stolen from, each server process's and thread's CPU share and switches, its own late wake-ups, and the
other processes that used the most CPU.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: radixlm's stdlib-only helpers
from radixlm.srt.utils import read_proc_stat  # noqa: E402

_INTERVAL = 0.25
_HEARTBEAT = 0.001
_LATE_MS = 3.0
_TICK = os.sysconf("SC_CLK_TCK")
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_ticks() -> dict[str, int]:
    first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return dict(zip(_FIELDS, map(int, first[1:9])))


def per_cpu() -> dict[str, tuple[int, int, int]]:
    """cpuN -> (irq, softirq, steal) ticks: time that CPU spent on interrupts and deferred interrupt work, and
    time the hypervisor ran something else while it had work; a thread on that CPU loses all three."""
    return {f[0]: (int(f[6]), int(f[7]), int(f[8])) for f in (line.split() for line in
            Path("/proc/stat").read_text().splitlines()) if f[0].startswith("cpu") and f[0] != "cpu"}


def interrupt_counts(path: str) -> dict[tuple[str, int], int]:
    """(source, cpu index) -> count, from /proc/interrupts or /proc/softirqs."""
    out = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    ncpu = len(lines[0].split())
    for line in lines[1:]:
        head, _, rest = line.partition(":")
        fields = rest.split()
        desc = " ".join(fields[ncpu:])[-30:]
        for i, v in enumerate(fields[:ncpu]):
            if v.isdigit():
                out[(f"{head.strip()} {desc}".strip(), i)] = int(v)
    return out


def busiest_interrupts(before: dict, after: dict, cpus: set[int], n: int = 6) -> list[list]:
    """The interrupt sources that fired most per second on `cpus` between two counts."""
    moved = sorted(((after[k] - before.get(k, 0), k) for k in after if k[1] in cpus), reverse=True)
    return [[src, cpu, count] for count, (src, cpu) in moved[:n] if count > 0]


def process_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user + system ticks) for every process readable now."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            name, rest = read_proc_stat(f"/proc/{entry.name}/stat")
        except OSError:
            continue
        out[int(entry.name)] = (name, int(rest[11]) + int(rest[12]), int(rest[1]))  # utime+stime, ppid
    return out


def tree(root: int, procs: dict) -> list[int]:
    kids: dict[int, list[int]] = {}
    for pid, (_, _, ppid) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += kids.get(pid, [])
    return found


def thread_counts(pid: int) -> dict[int, tuple[str, int, int, int, int, int]]:
    """tid -> (thread name, user + system ticks, involuntary switches, voluntary switches, moves between CPUs,
    the CPU it last ran on) for each thread of `pid`."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name, rest = read_proc_stat(f"/proc/{pid}/task/{tid}/stat")
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/task/{tid}/status").read_text()
                          .splitlines() if ":" in line)
            inv, vol = int(status["nonvoluntary_ctxt_switches"]), int(status["voluntary_ctxt_switches"])
        except (OSError, KeyError, ValueError):
            continue
        out[int(tid)] = (name, int(rest[11]) + int(rest[12]), inv, vol,
                         _sched_field(f"/proc/{pid}/task/{tid}/sched", "se.nr_migrations"), int(rest[36]))
    return out


def _sched_field(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(float(line.split(":", 1)[1]))
    except (OSError, ValueError):
        pass
    return 0


def machine_facts() -> dict:
    """Kernel settings that can stall a thread touching memory: NUMA nodes and automatic NUMA balancing (which
    unmaps pages now and then to see who touches them), transparent huge pages and their defragmentation."""
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "?"
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {"kernel": platform.release(), "numa_nodes": {n.name: read(f"{n}/cpulist") for n in nodes},
            "numa_balancing": read("/proc/sys/kernel/numa_balancing"),
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "clocksource": read("/sys/devices/system/clocksource/clocksource0/current_clocksource")}


_CGROUP_STATS = ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat")
_CGROUP_LIMITS = ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                  "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")


def throttling() -> dict[str, int]:
    """The CPU cgroup's throttling counters (a quota stops all of its threads once a period's share is spent)
    and the machine's CPU pressure (microseconds some task waited for a CPU)."""
    out: dict[str, int] = {}
    for path in _CGROUP_STATS:
        try:
            for line in Path(path).read_text().splitlines():
                key, value = line.split()
                if key in ("nr_periods", "nr_throttled", "throttled_usec", "throttled_time"):
                    out[key] = int(value)
            break
        except (OSError, ValueError):
            continue
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        out["cpu_pressure_us"] = int(some.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        pass
    return out


_VMSTAT = ("numa_hint_faults", "numa_pages_migrated", "pgmigrate_success", "compact_stall", "thp_fault_alloc",
           "pgmajfault", "allocstall_normal")


def vm_events() -> dict[str, int]:
    """Kernel memory events that stall whichever thread touches the page (NUMA balancing's hinting faults and
    migrations, direct compaction, huge-page faults): a CUDA call that stalls with the machine idle may be one."""
    out = {}
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            key, value = line.split()
            if key in _VMSTAT:
                out[key] = int(value)
    except (OSError, ValueError):
        pass
    return out


def cpu_limit() -> str:
    for path in _CGROUP_LIMITS:
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return "unknown"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return ""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    root, out = int(sys.argv[1]), Path(sys.argv[2])
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    t0, m0, p0 = time.monotonic(), machine_ticks(), process_ticks()
    server = tree(root, p0)
    th0 = {pid: thread_counts(pid) for pid in server}
    c0 = throttling()
    v0, pc0 = vm_events(), per_cpu()
    irq0, soft0 = interrupt_counts("/proc/interrupts"), interrupt_counts("/proc/softirqs")
    worst = {"busy": 0.0, "steal": 0.0}
    prev = m0
    late: list[tuple[float, float]] = []  # (time.perf_counter(), ms) of this probe's own late wake-ups
    while not stop:
        # A heartbeat of its own: a wake-up that comes late although this process has nothing else to do means
        # the machine or the container held every process back then (throttling, a paused vCPU), not ours alone.
        due = time.perf_counter() + _INTERVAL
        while not stop and time.perf_counter() < due:
            t = time.perf_counter()
            time.sleep(_HEARTBEAT)
            over = (time.perf_counter() - t - _HEARTBEAT) * 1e3
            if over > _LATE_MS:
                late.append((round(t, 6), round(over, 2)))
        cur = machine_ticks()
        total = sum(cur[f] - prev[f] for f in _FIELDS) or 1
        worst["busy"] = max(worst["busy"], 1 - (cur["idle"] - prev["idle"]) / total)
        worst["steal"] = max(worst["steal"], (cur["steal"] - prev["steal"]) / total)
        prev = cur
    secs, m1, p1 = time.monotonic() - t0, machine_ticks(), process_ticks()
    total = sum(m1[f] - m0[f] for f in _FIELDS) or 1
    ncpu = os.cpu_count() or 1
    share = {f: round((m1[f] - m0[f]) / total, 4) for f in _FIELDS}
    used = {pid: (p1[pid][1] - p0[pid][1]) / _TICK / secs for pid in p1 if pid in p0}
    c1 = throttling()
    v1, pc1 = vm_events(), per_cpu()
    irq1, soft1 = interrupt_counts("/proc/interrupts"), interrupt_counts("/proc/softirqs")
    lost = {c: [round((a - b) * 1e3 / _TICK / secs, 1) for a, b in zip(pc1[c], pc0.get(c, (0, 0, 0)))]
            for c in pc1}  # ms per second of irq, softirq, steal
    threads, main_switches = [], {}
    for pid in server:
        for tid, (name, ticks, inv, vol, moved, last_cpu) in thread_counts(pid).items():
            before = th0.get(pid, {}).get(tid, (name, 0, 0, 0, 0, 0))
            if tid == pid:  # the main thread: the process's own count, as /proc/PID/status gives it
                main_switches[pid] = inv - before[2]
            cpu, switched = (ticks - before[1]) / _TICK / secs, inv - before[2]
            if cpu >= 0.01 or switched:
                threads.append({"pid": pid, "tid": tid, "name": name, "cpu": round(cpu, 3), "involuntary": switched,
                                "voluntary": vol - before[3], "cpu_moves": moved - before[4],
                                "last_cpu": last_cpu})
    report = {
        "cpu_model": cpu_model(), "cpus": ncpu, "seconds": round(secs, 2), "facts": machine_facts(),
        "machine_share": share, "machine_busy_cpus": round((1 - share["idle"]) * ncpu, 2),
        "worst_interval": {k: round(v, 4) for k, v in worst.items()}, "interval_s": _INTERVAL,
        "cgroup_cpu_limit": cpu_limit(), "throttling": {k: c1[k] - c0.get(k, 0) for k in c1},
        "lost_ms_per_s_by_cpu": {c: dict(zip(("irq", "softirq", "steal"), v)) for c, v in
                                 sorted(lost.items(), key=lambda kv: -sum(kv[1]))[:6] if sum(v) > 0},
        "server_thread_cpus": sorted({t["last_cpu"] for t in threads}), "server_threads": threads,
        "own_late_wakeups": late, "vm_events": {k: v1[k] - v0.get(k, 0) for k in v1},
        "server": [{"pid": pid, "name": p1[pid][0], "cpu": round(used.get(pid, 0.0), 3),
                    "involuntary_per_s": round(main_switches.get(pid, 0) / secs, 1)}
                   for pid in server if pid in p1],
        "others": [{"pid": pid, "name": p1[pid][0], "cpu": round(c, 3), "cmd": cmdline(pid)}
                   for pid, c in sorted(used.items(), key=lambda kv: -kv[1]) if pid not in server and c >= 0.02][:8],
    }
    main_cpus = {t["last_cpu"] for t in threads if t["cpu"] >= 0.3}  # where the busy threads ran (the scheduler)
    report["interrupts_on_busy_cpus"] = busiest_interrupts(irq0, irq1, main_cpus)
    report["softirqs_on_busy_cpus"] = busiest_interrupts(soft0, soft1, main_cpus)
    if lost:  # and on the CPU that lost the most time
        hottest = int(max(lost, key=lambda c: sum(lost[c]))[3:])
        report["on_most_lost_cpu"] = {"cpu": hottest, "irqs": busiest_interrupts(irq0, irq1, {hottest}),
                                      "softirqs": busiest_interrupts(soft0, soft1, {hottest})}
    out.write_text(json.dumps(report, indent=1))
    srv = ", ".join(f"{p['name']} {p['cpu']:.2f} cpu {p['involuntary_per_s']:.0f} inv/s" for p in report["server"]
                    if p["cpu"] >= 0.01)
    print(f"host: {report['cpu_model']} x{ncpu}, busy {report['machine_busy_cpus']} cpus, steal "
          f"{share['steal']:.1%} (worst {worst['steal']:.1%}), throttling {report['throttling']}, own stalls "
          f"{len(late)} (max {max((ms for _, ms in late), default=0):.1f} ms); server: {srv}; others: "
          + ", ".join(f"{o['name']} {o['cpu']:.2f}" for o in report["others"][:4])
          + f"; numa nodes {len(report['facts']['numa_nodes'])} balancing {report['facts']['numa_balancing']}, "
          f"memory events {report['vm_events']}; lost ms/s by cpu {report['lost_ms_per_s_by_cpu']}; busy cpus "
          f"{sorted(main_cpus)}: irqs {report['interrupts_on_busy_cpus'][:3]} softirqs "
          f"{report['softirqs_on_busy_cpus'][:3]}")


if __name__ == "__main__":
    main()
