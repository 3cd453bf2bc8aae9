"""How much host work per step can a decode loop afford on this machine before its tail grows?

The loop has the server's overlap shape with nothing else in it: launch step n (a CUDA graph that keeps the GPU
busy STEP_MS), do W ms of host work (a fixed amount of interpreter work, calibrated at start: a slowed CPU takes
longer over it, as it would over the scheduler's), then wait for step n-1 and note when it was done. The gaps
between deliveries are the loop's inter-token latencies. Rounds interleave the W values so that each sees the
same moments of the machine. On a quiet machine every W under STEP_MS gives p99/p50 near 1; on one whose host
slows the vCPUs for tens of milliseconds, the W at which p99/p50 passes 2 is the host-work budget per step.

    python benchmarks/gpu/host_budget.py --work 0,1,2,4 --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.itl_tail import pct  # noqa: E402


def _calibrate_sleep(step_ms: float) -> int:
    """Cycles for torch.cuda._sleep that keep the GPU busy about step_ms."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        cycles = int(cycles * step_ms / start.elapsed_time(end))
    return cycles


def _work_unit(n: int) -> int:
    """Interpreter work of the scheduler's kind: dict and list traffic, small objects, attribute access."""
    acc, d = 0, {}
    for i in range(n):
        d[i & 63] = (i, str(i & 7))
        acc += len(d) + d[i & 63][0]
    return acc


def _calibrate_work() -> int:
    """Units of _work_unit(100) per ms, the median of several tries on an idle loop."""
    rates = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(200):
            _work_unit(100)
        rates.append(200 / ((time.perf_counter() - t) * 1e3))
    return max(1, int(statistics.median(rates)))


def _round(graph: torch.cuda.CUDAGraph, out: torch.Tensor, units: int, steps: int) -> tuple[list[float], float]:
    """Delivery gaps (ms) of `steps` overlapped steps with `units` of host work each, and the GPU's idle ms."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    gaps, last = [], None
    for n in range(steps):
        events[n][0].record()
        graph.replay()
        events[n][1].record()
        for _ in range(units):
            _work_unit(100)
        if n:
            events[n - 1][1].synchronize()
            out[0].item()  # the token copy the scheduler makes (the step is done, it is cheap)
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1e3)
            last = now
    events[-1][1].synchronize()
    busy = sum(events[n][0].elapsed_time(events[n][1]) for n in range(steps))
    return gaps, events[0][0].elapsed_time(events[-1][1]) - busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=8.0, help="GPU time of a step (c32 decode on the H100: ~7)")
    ap.add_argument("--work", default="0,1,2,4", help="host work per step to try, ms on an idle CPU")
    ap.add_argument("--steps", type=int, default=500, help="steps per round and W")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cycles = _calibrate_sleep(args.step_ms)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(cycles)
        out.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    per_ms = _calibrate_work()
    works = [float(w) for w in args.work.split(",")]
    gaps = {w: [] for w in works}
    idle = {w: 0.0 for w in works}
    for r in range(args.rounds):
        for w in works if r % 2 == 0 else works[::-1]:
            g, i = _round(graph, out, round(w * per_ms), args.steps)
            gaps[w] += g
            idle[w] += i
    rows = []
    for w in works:
        p50, p99 = pct(gaps[w], 50), pct(gaps[w], 99)
        rows.append({"work_ms": w, "n": len(gaps[w]), "p50_ms": p50, "p90_ms": pct(gaps[w], 90), "p99_ms": p99,
                     "max_ms": max(gaps[w]), "p99_over_p50": p99 / p50,
                     "over_2x_p50": sum(g > 2 * p50 for g in gaps[w]), "gpu_idle_ms": idle[w]})
    result = {"step_ms": args.step_ms, "work_units_per_ms": per_ms, "steps": args.steps, "rounds": args.rounds,
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"host budget (GPU step {args.step_ms} ms, {args.rounds} rounds x {args.steps} steps per W)")
    print(f"{'work ms':>8} {'p50':>7} {'p99':>7} {'p99/p50':>8} {'max':>7} {'>2xp50':>7} {'GPU idle ms':>12}")
    for r in rows:
        print(f"{r['work_ms']:8.1f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {r['p99_over_p50']:8.2f} "
              f"{r['max_ms']:7.1f} {r['over_2x_p50']:7d} {r['gpu_idle_ms']:12.1f}")


if __name__ == "__main__":
    main()
