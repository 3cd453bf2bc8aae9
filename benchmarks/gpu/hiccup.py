"""Does the machine take CPUs away from running threads? One spinning process per given CPU reads the clock in a
tight loop and notes every gap over GAP_MS: time the vCPU was not running it although it never yielded
(hypervisor preemption the guest may not report as steal, or interrupts and softirqs on that CPU), and every
WINDOW_MS window in which it got through under SLOW of its median number of loops (a CPU slowed down: a busy
sibling thread on its core, memory contention).

    python benchmarks/gpu/hiccup.py --cpus 9,10 --out OUT.json &   # ... run the workload ...; kill -INT $!

Run it on CPUs the server does not use, beside a run whose scheduler thread is seen on a CPU through long phases
(stall_sampler.py): gaps here as long and as often mean the machine, not our code.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time

GAP_MS = 1.0
WINDOW_MS = 5.0  # it also counts its loop iterations per window: a CPU slowed, not taken away, shows there
SLOW = 0.6  # a window under this share of the median rate is slow


def spin(cpu: int, stop, out) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through `stop`
    os.sched_setaffinity(0, {cpu})
    gaps: list[tuple[float, float]] = []
    windows: list[tuple[float, int]] = []  # (start, loop iterations) per WINDOW_MS: how fast it ran
    clock = time.perf_counter
    start = last = window = clock()
    n = done = 0
    while True:
        t = clock()
        if t - last > GAP_MS / 1e3:
            gaps.append((round(last, 6), round((t - last) * 1e3, 3)))
        if t - window > WINDOW_MS / 1e3:
            windows.append((window, n - done))
            window, done = t, n
        last = t
        n += 1
        if n % 65536 == 0 and stop.is_set():
            break
    ms = [g for _, g in gaps]
    rates = sorted(c for _, c in windows)
    median = rates[len(rates) // 2] if rates else 0
    slow = [(round(w, 6), round(c / median, 2)) for w, c in windows if median and c < SLOW * median]
    out.put({"cpu": cpu, "seconds": round(last - start, 2), "gaps": len(ms), "gap_ms_total": round(sum(ms), 1),
             "over_5ms": sum(g > 5 for g in ms), "over_10ms": sum(g > 10 for g in ms),
             "max_ms": max(ms, default=0.0), "longest": sorted(gaps, key=lambda g: -g[1])[:10],
             "windows": len(windows), "slow_windows": len(slow), "slow": slow[:200]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", required=True, help="comma-separated CPU numbers, one spinner each")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=600.0, help="stop by itself after this long")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=spin, args=(int(c), stop, out), daemon=True) for c in args.cpus.split(",")]
    for p in procs:
        p.start()
    stopped: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: stopped.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    deadline = time.monotonic() + args.seconds
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    results = sorted((out.get(timeout=30) for _ in procs), key=lambda r: r["cpu"])
    for p in procs:
        p.join(5)
    with open(args.out, "w") as f:
        json.dump({"gap_ms": GAP_MS, "cpus": results}, f, indent=1)
    print("hiccup (cpu, gaps, >5 ms, >10 ms, max ms, slow windows):",
          [(r["cpu"], r["gaps"], r["over_5ms"], r["over_10ms"], r["max_ms"], r["slow_windows"]) for r in results])


if __name__ == "__main__":
    main()
