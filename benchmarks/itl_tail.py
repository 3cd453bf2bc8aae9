"""Where does inter-token latency's tail come from? Lines up a client's chunk arrival times with the server's step
trace (same machine, both on CLOCK_MONOTONIC) and classifies every slow gap.

    RADIXLM_STEP_TRACE=/tmp/steps.jsonl radixlm serve ...        # the server records its steps
    python benchmarks/bench_serving.py ... --save-chunk-times --out run.json
    curl -X POST localhost:30000/flush_cache                     # writes out the trace's last lines
    python benchmarks/itl_tail.py /tmp/steps.jsonl run.json [--out tail.json]

A gap is slow when it exceeds twice the ITL median. Each one is put in one class:
  long step   one server step (or its device wait) covers most of the gap: the step itself was slow;
  skipped     the gap spans two or more server steps: the stream missed a step (an extend step without decode
              riders, or it was not scheduled);
  delivery    the server's steps in the gap were short and few: the token waited in the output path
              (detokenizer, tokenizer manager, HTTP, client).
Where the output path traced itself too (the detokenizer's and tokenizer manager's files beside the step trace,
the client's own collector passes and loop stalls in its JSON), the report adds each hop's latency and puts
every delivery gap against what overlapped it: a collector pass or a loop stall in the server's HTTP process,
in the client, in the detokenizer, or a slow hop.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
from collections import Counter
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


def load_steps(path: Path) -> list[dict]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps.sort(key=lambda s: s["t"])
    prev = None
    for s in steps:
        s["ms"] = sum(s.get("phases_ms", {}).values())
        # what moved during this step: collector passes, device mallocs/frees, allocator retries
        s["events"] = [] if prev is None else (
            (["gc"] if s.get("gc", 0) != prev.get("gc", 0) else []) +
            [k for k, a, b in zip(("malloc", "free", "retry"), s.get("cuda_alloc", [0] * 3),
                                  prev.get("cuda_alloc", [0] * 3)) if a != b])
        s["after"] = None if prev is None else f"{prev.get('mode')}:{prev.get('tokens')}"
        prev = s
    return steps


def step_summary(steps: list[dict], maps: str | None = None, syms: dict | None = None) -> dict:
    out = {}
    for mode in sorted({s.get("mode", "?") for s in steps}):
        sel = [s for s in steps if s.get("mode") == mode]
        phases = {p: [s["phases_ms"].get(p, 0.0) for s in sel] for p in sel[0].get("phases_ms", {})}
        out[mode] = {"steps": len(sel), "ms_p50": pct([s["ms"] for s in sel], 50),
                     "ms_p99": pct([s["ms"] for s in sel], 99),
                     "phase_p50": {p: round(pct(v, 50), 3) for p, v in phases.items()},
                     "phase_p99": {p: round(pct(v, 99), 3) for p, v in phases.items()}}
    starts = [s["t"] for s in steps]
    gaps = [(b - a) * 1e3 - s["ms"] for a, b, s in zip(starts, starts[1:], steps)]  # loop time between steps
    out["between_steps_ms"] = {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": max(gaps, default=0.0)}
    median = pct([s["ms"] for s in steps], 50)
    slow = [s for s in steps if s["ms"] > 2 * median]
    out["slow_steps_with_events"] = {e: sum(e in s.get("events", []) for s in slow) for e in ("gc", "malloc", "free",
                                                                                             "retry")}
    out["slow_steps"] = len(slow)
    # Where the scheduler thread was when a phase ran long (the trace's watcher took its stack then).
    caught = Counter(f"{phase}: {' < '.join(reversed(stack[-3:]))}" for s in steps
                     for phase, stack in s.get("stacks", {}).items())
    if caught:
        out["phase_stall_stacks"] = dict(caught.most_common(10))
    stalls = [st for s in steps for st in s.get("stalls", [])]
    missed = sum(s.get("stalls_missed", 0) for s in steps)
    if missed:  # caught, but the phase ended while the watcher read the thread's state
        out["stalls_missed"] = missed
    if stalls:
        out["phase_stalls"] = stall_summary(stalls, maps, syms)
    return out


_SYSCALLS = {"0": "read", "1": "write", "7": "poll", "9": "mmap", "10": "mprotect", "11": "munmap", "16": "ioctl",
             "24": "sched_yield", "28": "madvise", "35": "nanosleep", "202": "futex", "230": "clock_nanosleep",
             "232": "epoll_wait", "281": "epoll_pwait"}  # x86-64


def mapping_of(addr: int, maps: str) -> str:
    """Which of a process's mappings (from its /proc/PID/maps text) holds `addr`: a library's name, [heap],
    or anon."""
    for line in maps.splitlines():
        fields = line.split(None, 5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= addr < hi:
            return os.path.basename(fields[5]) if len(fields) > 5 else "anon"
    return "unmapped"


def _named(frames: list[str], syms: dict, n: int = 4) -> list[str]:
    """The program counter, then the first frames that carry an exported name (lib!name+off), `n` in all;
    raw addresses are named from the trace's `.syms` file."""
    frames = [syms.get(f, f) for f in frames]
    return (frames[:1] + [f for f in frames[1:] if "!" in f])[:n]


def stall_summary(stalls: list[dict], maps: str | None = None, syms: dict | None = None) -> dict:
    """Where the scheduler thread's caught stalls went, as the kernel saw the thread: on a CPU (work, ours or
    the kernel's for us), runnable but off one (contention), or neither (waiting on a lock, the driver)."""
    timed = [st for st in stalls if "on_cpu_ms" in st]
    window = sum(st["window_ms"] for st in timed)
    on_cpu = sum(st["on_cpu_ms"] for st in timed)
    runq = sum(st["runq_ms"] for st in timed)
    where = Counter(f"{st.get('state', '?')} {_SYSCALLS.get(st.get('syscall', '?'), st.get('syscall', '?'))} "
                    f"{st.get('wchan', '-')}" for st in stalls)
    out = {}
    # the lock a stalled thread sleeps on, by the mapping its address is in (a driver's, the interpreter's)
    futexes = Counter(mapping_of(int(st["syscall_args"][0], 16), maps) if maps else st["syscall_args"][0]
                      for st in stalls if st.get("syscall") == "202" and st.get("syscall_args"))
    if futexes:
        out["futex_in"] = dict(futexes.most_common(6))
    # the process's other threads on a CPU at that moment: a lock's holder would be one
    running = Counter(f"{name} {call}" for st in stalls for _, name, state, call, _ in st.get("threads", [])
                      if state == "R")
    if running:
        out["others_running"] = dict(running.most_common(6))
    kstacks = Counter(" < ".join(st["kstack"][:3]) for st in stalls if st.get("kstack"))
    if kstacks:
        out["kernel_stacks"] = dict(kstacks.most_common(6))
    # native stack guesses: the innermost named frames say which call (a CUDA entry point, the GIL) it sleeps in
    syms = syms or {}
    native = Counter(" < ".join(_named(st["native"], syms)) for st in stalls if st.get("native"))
    if native:
        out["native_stacks"] = dict(native.most_common(8))
    owners = Counter(f"{o['name']} {o['state']} {_SYSCALLS.get(o['syscall'], o['syscall'])}: "
                     + " < ".join(_named(o.get("native", []), syms)) for st in stalls
                     if (o := st.get("futex_owner")))
    if owners:
        out["futex_owners"] = dict(owners.most_common(6))
    blocked = Counter(f"{who}: " + " < ".join(_named(frames, syms)) for st in stalls
                      for who, frames in st.get("blocked_native", {}).items())
    if blocked:
        out["blocked_in_driver"] = dict(blocked.most_common(6))
    return {**out, "caught": len(stalls), "state_syscall_wchan": dict(where.most_common(8)),
            "after_caught_ms": {"window": round(window, 1), "on_cpu": round(on_cpu, 1), "runq": round(runq, 1),
                                "off_cpu": round(window - on_cpu - runq, 1)},
            "moved_cpu": sum(st.get("cpu") != st.get("cpu_after") for st in timed)}


def classify(steps: list[dict], chunk_times: list[list[float]]) -> dict:
    gaps = [(a, b) for times in chunk_times for a, b in zip(times[1:], times[2:])]  # times[0] is the send
    itl = [(b - a) * 1e3 for a, b in gaps]
    p50 = statistics.median(itl)
    starts = [s["t"] for s in steps]
    classes: Counter = Counter()
    slow_modes: Counter = Counter()
    long_steps: list[dict] = []
    delivery: list[tuple[float, float]] = []
    for (a, b), ms in zip(gaps, itl):
        if ms <= 2 * p50:
            continue
        lo = max(0, bisect.bisect_left(starts, a) - 1)
        hi = bisect.bisect_right(starts, b)
        window = [s for s in steps[lo:hi] if s["t"] + s["ms"] / 1e3 > a and s["t"] < b]
        longest = max(window, key=lambda s: s["ms"], default=None)
        if longest is not None and longest["ms"] >= 0.6 * ms:
            classes["long step"] += 1
            slow_modes[longest.get("mode", "?")] += 1
            long_steps.append(longest)
        elif len(window) >= 2:
            classes["skipped"] += 1
            slow_modes["+".join(s.get("mode", "?") for s in window[:4])] += 1
        else:
            classes["delivery"] += 1
            delivery.append((a, b))
    # One long step makes a slow gap in every stream it carried: list each step once.
    unique = sorted({id(s): s for s in long_steps}.values(), key=lambda s: -s["ms"])
    slowest = [{k: s.get(k) for k in ("mode", "batch_size", "tokens", "decode_riders", "ms", "phases_ms", "events",
                                      "after", "stacks", "stalls") if k in s} for s in unique[:10]]
    return {"itl_ms": {"p50": p50, "p90": pct(itl, 90), "p99": pct(itl, 99), "n": len(itl)},
            "slow_gaps": sum(classes.values()), "classes": dict(classes),
            "slow_step_modes": dict(slow_modes.most_common(8)), "slowest_steps": slowest,
            "delivery_gaps": delivery}


def load_events(trace: Path, client: dict) -> dict[str, list[dict]]:
    """Output-path records by process: tokenizer / detokenizer (beside the step trace) and client."""
    out = {"client": client.get("client_events") or []}
    for kind in ("tokenizer", "detokenizer"):
        f = trace.with_name(f"{trace.stem}.{kind}{trace.suffix}")
        out[kind] = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []
    return out


def output_path(events: dict[str, list[dict]], t0: float, t1: float) -> dict:
    """Hop latencies and each process's collector passes and loop stalls inside the client's run."""
    res: dict = {"hops_ms": {}, "gc": {}, "lag": {}}
    tok = [e for e in events["tokenizer"] if e["k"] == "batch" and t0 <= e["recv"] <= t1]
    det = [e for e in events["detokenizer"] if e["k"] == "batch" and t0 <= e["recv"] <= t1]
    hops = {"scheduler->detokenizer": [(e["recv"] - e["sched"]) * 1e3 for e in det if e.get("sched")],
            "detokenizer work": [(e["sent"] - e["recv"]) * 1e3 for e in det],
            "detokenizer->tokenizer": [(e["recv"] - e["detok"]) * 1e3 for e in tok if e.get("detok")],
            "scheduler->tokenizer": [(e["recv"] - e["sched"]) * 1e3 for e in tok if e.get("sched")]}
    for name, v in hops.items():
        if v:
            res["hops_ms"][name] = {"p50": round(pct(v, 50), 3), "p99": round(pct(v, 99), 3), "max": round(max(v), 3)}
    for proc, evs in events.items():
        gcs = [e for e in evs if e["k"] == "gc" and t0 <= e["t"] <= t1]
        lags = [e for e in evs if e["k"] == "lag" and t0 <= e["t"] <= t1]
        if gcs:
            res["gc"][proc] = {"passes": len(gcs), "by_gen": dict(Counter(e["gen"] for e in gcs)),
                               "total_ms": round(sum(e["ms"] for e in gcs), 2), "max_ms": max(e["ms"] for e in gcs)}
        if lags:
            res["lag"][proc] = {"stalls": len(lags), "max_ms": max(e["ms"] for e in lags),
                                "total_ms": round(sum(e["ms"] for e in lags), 2)}
            # Where the loop thread was in the stalls the watcher caught (innermost frames), longest first.
            caught = sorted((e for e in lags if e.get("stack")), key=lambda e: -e["ms"])
            if caught:
                res["lag"][proc]["stacks"] = {"caught": len(caught), "no_stack": len(lags) - len(caught),
                                              "longest": [{"ms": e["ms"], "top": e["stack"][-4:]}
                                                          for e in caught[:5]],
                                              "by_frame": dict(Counter(e["stack"][-1] for e in caught).most_common(8))}
    return res


def blame_delivery(gaps: list[tuple[float, float]], events: dict[str, list[dict]]) -> dict:
    """For each delivery gap, the output-path events that overlap it (a gap can have several causes)."""
    spans = []  # (start, end, cause)
    for proc, evs in events.items():
        for e in evs:
            if e["k"] == "gc" and e["ms"] >= 1.0:
                spans.append((e["t"], e["t"] + e["ms"] / 1e3, f"{proc} gc"))
            elif e["k"] == "lag":
                spans.append((e["t"], e["t"] + (e["ms"] + 1.0) / 1e3, f"{proc} loop stall"))
            elif e["k"] == "batch" and proc == "tokenizer" and e.get("sched") and e["recv"] - e["sched"] > 0.002:
                spans.append((e["sched"], e["recv"], "slow hop to tokenizer"))
    spans.sort()
    starts = [s[0] for s in spans]
    blame: Counter = Counter()
    for a, b in gaps:
        hit = {c for s, e, c in spans[max(0, bisect.bisect_left(starts, a - 0.1)):bisect.bisect_right(starts, b)]
               if s < b and e > a}
        blame.update(hit or {"nothing traced"})
    return dict(blame.most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("client", type=Path, help="bench_serving JSON written with --save-chunk-times")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    report = json.loads(args.client.read_text())
    times = report.get("chunk_times") or []
    if not times:
        raise SystemExit(f"{args.client}: no chunk_times (run bench_serving with --save-chunk-times)")
    t0, t1 = min(t[0] for t in times), max(t[-1] for t in times)
    steps = [s for s in load_steps(args.trace) if t0 <= s["t"] <= t1]  # the client's run only
    if not steps:
        raise SystemExit("no server steps inside the client's run: are both on one machine and one trace file?")
    maps_file = args.trace.with_suffix(".maps")  # the scheduler's mappings, when its stalls recorded addresses
    maps = maps_file.read_text() if maps_file.exists() else None
    syms_file = args.trace.with_suffix(".syms")  # names of the code addresses in its stalls' stack guesses
    syms = json.loads(syms_file.read_text()) if syms_file.exists() else None
    res = {"label": report.get("label"), "steps": step_summary(steps, maps, syms), **classify(steps, times)}
    events = load_events(args.trace, report)
    res["output_path"] = output_path(events, t0, t1)
    res["delivery_blame"] = blame_delivery(res.pop("delivery_gaps"), events)
    print(f"{res['label']}: ITL p50 {res['itl_ms']['p50']:.1f} ms, p99 {res['itl_ms']['p99']:.1f} ms; "
          f"{res['slow_gaps']} gaps > 2x p50 of {res['itl_ms']['n']}: {res['classes']}")
    print("  slow gaps by server step kind:", res["slow_step_modes"])
    for mode, st in res["steps"].items():
        print(f"  {mode:>16}: {st}")
    for s in res["slowest_steps"][:5]:
        print("  slow step:", s)
    print("  output path:", res["output_path"])
    print("  delivery gaps overlapped by:", res["delivery_blame"])
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
