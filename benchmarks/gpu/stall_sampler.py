"""Where the scheduler thread is when a step phase runs long, seen from another process.

    RADIXLM_PHASE_BOARD=/dev/shm/board python -m radixlm.launch_server ... &
    python benchmarks/gpu/stall_sampler.py /dev/shm/board OUT.json &   # ... run the workload ...; kill -INT $!

The server's scheduler writes its current phase and when it began to the board (srt/managers/phase_board.py).
This process polls it every half millisecond; once a phase has run past its usual length (as the step trace's
watcher judges it) it reads the scheduler thread's state, system call, native stack guess and, for a futex, the
mutex's holder (a thread running on a CPU is stopped with ptrace for some tens of microseconds to read its
registers), plus every other thread's state, up to SAMPLES times while the phase lasts, and when the phase
ends how much of the time since was spent on a CPU or queued for one. Unlike the step trace's watcher it takes
nothing from the scheduler (no GIL, no thread of its own there), so it works with the trace off and cannot be
the cause of what it measures. On SIGINT it names the code addresses (the same libraries, mapped here) and
writes the records with a summary (benchmarks/itl_tail.py's stall_summary).
Needs ptrace rights over the server (same user, or root) for its memory.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.itl_tail import stall_summary  # noqa: E402
from radixlm.srt.managers.native_stack import (cached_code_map, code_map, interrupt_registers,  # noqa: E402
                                               stack_guess, symbolize_foreign)
from radixlm.srt.managers.phase_board import SIZE, read_board  # noqa: E402
from radixlm.srt.managers.step_trace import (StepTrace, native_addresses, other_threads, schedstat,  # noqa: E402
                                             thread_state)
from radixlm.srt.utils import read_proc_stat  # noqa: E402

POLL_S = 0.0005
SAMPLES = 3  # per long phase, at least SPACING_MS apart
SPACING_MS = 2.0


def _open_board(path: str, stop) -> mmap.mmap | None:
    while not stop():
        try:
            if os.path.getsize(path) >= SIZE:
                with open(path, "rb") as f:
                    mem = mmap.mmap(f.fileno(), SIZE, prot=mmap.PROT_READ)
                if read_board(mem)[0]:
                    return mem
        except OSError:
            pass
        time.sleep(0.05)
    return None


def sample(board_path: str, stop, interrupt: bool = True) -> tuple[int, list[dict], int]:
    """Poll until `stop()`: (server pid, stall records, long phases seen)."""
    mem = _open_board(board_path, stop)
    if mem is None:
        return 0, [], 0
    pid, tid = read_board(mem)[:2]
    code_map(pid)  # read its code mappings once now: reading them while a phase stalls takes too long
    limits = StepTrace.PHASE_STACK_MS
    records: list[dict] = []
    open_recs: list[tuple[dict, tuple[int, int] | None, int]] = []  # this phase's samples, awaiting its end
    cur_seq, taken, last_ms, phases = -1, 0, 0.0, 0
    while not stop():
        time.sleep(POLL_S)
        _, _, seq, phase, start = read_board(mem)
        now = time.monotonic_ns()
        if seq != cur_seq:
            for rec, before, t in open_recs:  # the phase these samples were taken in has ended
                after = schedstat(tid, pid)
                rec["window_ms"] = round((now - t) / 1e6, 2)
                if before is not None and after is not None:
                    rec["on_cpu_ms"] = round((after[0] - before[0]) / 1e6, 2)
                    rec["runq_ms"] = round((after[1] - before[1]) / 1e6, 2)
                try:
                    rec["cpu_after"] = int(read_proc_stat(f"/proc/{pid}/task/{tid}/stat")[1][36])
                except OSError:
                    pass  # the server is gone
            open_recs, cur_seq, taken = [], seq, 0
        if phase is None or taken >= SAMPLES:
            continue
        ms = (now - start) / 1e6
        if ms < limits[phase] or (taken and ms - last_ms < SPACING_MS):
            continue
        before, t = schedstat(tid, pid), time.monotonic_ns()
        rec = {"phase": phase, "seq": seq, "t": round(start / 1e9, 6), "at_ms": round(ms, 2), "sample": taken,
               **thread_state(tid, pid=pid, native=True)}
        if rec.get("syscall") == "running" and interrupt:  # running: stop it briefly for its registers
            regs = interrupt_registers(tid)
            if regs is not None:
                rec["native"] = [f"{a:#x}" for a in stack_guess(tid, cached_code_map(pid), pid, regs)]
                rec["interrupted"] = True
        if read_board(mem)[2] != seq:
            continue  # the phase ended while the state was read
        rec.update(other_threads(tid, pid, native=True))  # may run past the phase: the other threads matter less
        phases += taken == 0
        taken, last_ms = taken + 1, ms
        records.append(rec)
        open_recs.append((rec, before, t))
    return pid, records, phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("board")
    ap.add_argument("out")
    ap.add_argument("--no-interrupt", action="store_true",
                    help="never stop a running scheduler thread (ptrace) to read its registers")
    args = ap.parse_args()
    stopped = []
    signal.signal(signal.SIGINT, lambda *_: stopped.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    pid, records, phases = sample(args.board, lambda: bool(stopped), not args.no_interrupt)
    syms, maps = {}, None
    if records:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            syms = symbolize_foreign(set().union(*(native_addresses(r) for r in records)), maps)
        except OSError as e:  # the server is gone: the addresses stay raw
            print(f"stall_sampler: cannot name addresses: {e}", file=sys.stderr)
    first = [r for r in records if r["sample"] == 0]
    out = {"pid": pid, "long_phases": phases, "by_phase": {p: sum(r["phase"] == p for r in first)
                                                           for p in StepTrace.PHASE_STACK_MS},
           "summary_first_samples": stall_summary(first, maps, syms) if first else None,
           "summary_all_samples": stall_summary(records, maps, syms) if records else None,
           "records": records, "syms": syms}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"stall_sampler: {phases} long phases, {len(records)} samples -> {args.out}")


if __name__ == "__main__":
    main()
