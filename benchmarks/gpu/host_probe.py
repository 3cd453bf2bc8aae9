"""Is the host quiet? Samples the machine's CPU accounting while a benchmark runs, so that a latency tail can be
put down to our processes or to the machine (steal time from a busy hypervisor, other processes' load).

    python benchmarks/gpu/host_probe.py SERVER_PID OUT.json &   # ... run the workload ...; kill -INT $!

Every 0.25 s it reads /proc/stat (user, system, iowait, steal, idle across all CPUs) and, for the server's process
tree and every other process, its CPU ticks and (for the server's) involuntary context switches: a process that
is runnable but put off the CPU by another counts one. On SIGINT it writes a summary: the machine's busy and
steal shares (mean and the worst interval), each server process's CPU share and involuntary switches per second,
and the other processes that used the most CPU.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

_INTERVAL = 0.25
_TICK = os.sysconf("SC_CLK_TCK")
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_ticks() -> dict[str, int]:
    first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return dict(zip(_FIELDS, map(int, first[1:9])))


def process_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user + system ticks) for every process readable now."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2:].split()
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


def switches(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


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
    s0 = {pid: switches(pid) for pid in server}
    worst = {"busy": 0.0, "steal": 0.0}
    prev = m0
    while not stop:
        time.sleep(_INTERVAL)
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
    report = {
        "cpu_model": cpu_model(), "cpus": ncpu, "seconds": round(secs, 2),
        "machine_share": share, "machine_busy_cpus": round((1 - share["idle"]) * ncpu, 2),
        "worst_interval": {k: round(v, 4) for k, v in worst.items()}, "interval_s": _INTERVAL,
        "server": [{"pid": pid, "name": p1[pid][0], "cpu": round(used.get(pid, 0.0), 3),
                    "involuntary_per_s": round((switches(pid) - s0.get(pid, 0)) / secs, 1)}
                   for pid in server if pid in p1],
        "others": [{"pid": pid, "name": p1[pid][0], "cpu": round(c, 3), "cmd": cmdline(pid)}
                   for pid, c in sorted(used.items(), key=lambda kv: -kv[1]) if pid not in server and c >= 0.02][:8],
    }
    out.write_text(json.dumps(report, indent=1))
    srv = ", ".join(f"{p['name']} {p['cpu']:.2f} cpu {p['involuntary_per_s']:.0f} inv/s" for p in report["server"]
                    if p["cpu"] >= 0.01)
    print(f"host: {report['cpu_model']} x{ncpu}, busy {report['machine_busy_cpus']} cpus, steal "
          f"{share['steal']:.1%} (worst {worst['steal']:.1%}); server: {srv}; others: "
          + ", ".join(f"{o['name']} {o['cpu']:.2f}" for o in report["others"][:4]))


if __name__ == "__main__":
    main()
