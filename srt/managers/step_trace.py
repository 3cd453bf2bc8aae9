"""Optional per-step trace of the scheduler, for finding where inter-token latency tails come from.

Set RADIXLM_STEP_TRACE=path (a file, or a directory to get one file per scheduler process) and the scheduler
appends one JSON line per step: start time, kind, batch size, tokens, decode riders, outputs and its host
phases, the cyclic collector's pass count and, on CUDA, the caching allocator's device malloc / free / retry
counts (cumulative: a step whose counts moved paid for a device sync). Lines are buffered and written every
few hundred steps, on /flush_cache and at exit, so tracing costs the step loop no file I/O in between.

The output path traces itself beside it (`ProcessTrace`: the detokenizer and the tokenizer manager write
`<trace>.detokenizer.jsonl` / `<trace>.tokenizer.jsonl`): one line per output batch with the time each process
handled it, plus every collector pass and, in the asyncio process, every event-loop stall, so a token that was
sampled on time but reached the client late can be pinned to a hop.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path

from radixlm.srt.managers.cpu_guard import current_cpu
from radixlm.srt.utils import read_proc_stat


def trace_path(kind: str) -> Path | None:
    """Where process `kind` writes its trace, from RADIXLM_STEP_TRACE (a directory: one file per process; a
    file: the scheduler's steps there, the other processes' beside it as <stem>.<kind><suffix>)."""
    target = os.environ.get("RADIXLM_STEP_TRACE")
    if not target:
        return None
    path = Path(target)
    if path.is_dir():
        return path / f"{kind}-{os.getpid()}.jsonl"
    return path if kind == "steps" else path.with_name(f"{path.stem}.{kind}{path.suffix}")


class _JsonlTrace:
    """Lines buffered in memory and appended to `path` every FLUSH_EVERY lines, on flush() and at exit (with no
    path they stay in `lines`)."""

    FLUSH_EVERY = 512

    def __init__(self, path: Path | None):
        self.path = path
        self.lines: list[str] = []
        atexit.register(self.flush)

    def _add(self, rec: dict) -> None:
        self.lines.append(json.dumps(rec))
        if len(self.lines) >= self.FLUSH_EVERY:
            _JsonlTrace.flush(self)  # the lines only: a subclass's extras wait for a quiet moment

    def flush(self) -> None:
        if self.lines and self.path is not None:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines = []


def _stack(frame) -> list[str]:
    import traceback

    return [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-12:]]


def thread_state(tid: int, others: bool = False, pid: int | str = "self", native: bool = False) -> dict:
    """What the kernel says a thread of process `pid` is doing now: state, CPU, system call and its first two
    arguments (a futex's address, an ioctl's request), wait channel, kernel stack where readable; with `native`,
    a native stack guess and a futex's holder (see _native_state); with `others`, every other thread's state,
    system call and CPU too (a lock's holder may be among them)."""
    from radixlm.srt.managers.native_stack import syscall_registers

    base, out, regs = f"/proc/{pid}/task/{tid}", {}, None
    try:
        rest = read_proc_stat(f"{base}/stat")[1]
        out["state"], out["cpu"] = rest[0], int(rest[36])  # stat's fields 3 and 39
        call = Path(f"{base}/syscall").read_text().split()
        out["syscall"] = call[0]  # a number, or "running"
        regs = syscall_registers(call)
        if regs is not None:
            out["syscall_args"] = call[1:3]
        out["wchan"] = Path(f"{base}/wchan").read_text().strip() or "-"
        out["kstack"] = [line.split()[-1] for line in Path(f"{base}/stack").read_text().splitlines()[:4]]
    except (OSError, IndexError, ValueError):
        pass
    if native:
        try:
            _native_state(tid, out, pid, regs)
        except (OSError, ValueError, IndexError):
            pass
    if others:
        out.update(other_threads(tid, pid, native))
    return out


def _thread_row(pid: int | str, tid: int | str) -> list | None:
    """[tid, name, state, system call, cpu] of one thread, or None once it is gone."""
    try:
        name, rest = read_proc_stat(f"/proc/{pid}/task/{tid}/stat")
        call = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()[0]
    except (OSError, IndexError, ValueError):
        return None
    return [int(tid), name, rest[0], call, int(rest[36])]


def other_threads(tid: int, pid: int | str = "self", native: bool = False) -> dict:
    """`threads`: every other thread of the process as [tid, name, state, system call, cpu]; with `native`,
    `blocked_native`: the stack guesses of those blocked in the driver (ioctl) or the kernel (D), where a
    lock's holder may wait."""
    rows = [r for t in os.listdir(f"/proc/{pid}/task") if t != str(tid) and (r := _thread_row(pid, t))]
    out: dict = {"threads": rows}
    blocked = [r for r in rows if r[2] == "D" or r[3] == "16"][:4]
    if native and blocked:
        from radixlm.srt.managers.native_stack import cached_code_map, stack_guess

        code = cached_code_map(pid)
        out["blocked_native"] = {f"{r[0]} {r[1]} {r[3]}": [f"{a:#x}" for a in stack_guess(r[0], code, pid)[:12]]
                                 for r in blocked}
    return out


def _native_state(tid: int, out: dict, pid: int | str = "self", regs: tuple[int, int] | None = None) -> None:
    """Add the thread's native stack guess (raw addresses, named later: see native_stack; `regs` as its
    system call file gave them, if read already) and, for a futex, the mutex's holder if it is a thread of the
    same process, with its state and stack guess. Uses the code map as last read: reading a CUDA process's
    mappings can take longer than the stall it would explain."""
    from radixlm.srt.managers.native_stack import cached_code_map, futex_owner, stack_guess

    code = cached_code_map(pid)
    out["native"] = [f"{a:#x}" for a in stack_guess(tid, code, pid, regs)]
    if out.get("syscall") == "202" and out.get("syscall_args"):
        tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
        owner = futex_owner(int(out["syscall_args"][0], 16), tids, pid)
        row = _thread_row(pid, owner) if owner is not None else None
        if row is not None:
            _, name, state, call, cpu = row
            out["futex_owner"] = {"tid": owner, "name": name, "state": state, "syscall": call, "cpu": cpu,
                                  "native": [f"{a:#x}" for a in stack_guess(owner, code, pid)]}


def native_addresses(stall: dict) -> set[int]:
    """Every raw code address a stall record carries."""
    lists = [stall.get("native", []), stall.get("futex_owner", {}).get("native", []),
             *stall.get("blocked_native", {}).values()]
    return {int(a, 16) for frames in lists for a in frames}


def schedstat(tid: int, pid: int | str = "self") -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) so far, for a thread of process `pid`."""
    try:
        on_cpu, waiting = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return None


class StepTrace(_JsonlTrace):
    """The scheduler's steps. The scheduler names each phase as it enters it (`phase`); a watcher thread takes
    the scheduler thread's stack once whenever a phase runs past its usual length (PHASE_STACK_MS), and the
    step's line carries those stacks: a phase stalled inside a call that lets go of the GIL (a CUDA call that
    waits for the device, a lock) shows that call; one with no stack held the GIL or was not scheduled.

    With each stack goes what the kernel says of the thread then (`stalls`): its state (R running or runnable,
    S sleeping, D in uninterruptible wait), the system call it is in and the kernel function it waits in, and,
    over the rest of the phase, how long it was on a CPU and how long runnable but waiting for one. A stall
    spent on a CPU is work (ours, or the kernel's on our behalf: page faults, NUMA scanning); one spent waiting
    for a CPU is contention; one spent in neither is a wait (a lock, the driver, the device).

    The watcher needs the GIL to look, so the scheduler thread may be caught waiting for the watcher itself:
    for an observer that takes nothing from this process, see benchmarks/gpu/stall_sampler.py."""

    PHASE_STACK_MS = {"schedule": 3.0, "forward": 3.0, "process": 14.0, "sample": 3.0}
    SAMPLE_S = 0.002

    def __init__(self, path: Path | None):
        super().__init__(path)
        self._phase: tuple[str, float] | None = None
        self._stacks: list[tuple[str, list[str]]] = []
        self._stalls: list[dict] = []
        self._addresses = False  # a stall recorded a system call's arguments: write the mappings out too
        self._code: set[int] = set()  # raw code addresses in stall records, named at the next flush()
        self.missed = 0
        self._late = 0.0
        self._pending: tuple[dict, tuple[int, int] | None, float] | None = None  # a stall whose phase runs on
        import threading

        self._tid = threading.get_native_id()
        threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True,
                         name="step-stall-watch").start()

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        path = trace_path("steps")
        return cls(path) if path is not None else None

    def phase(self, name: str | None) -> None:
        if self._pending is not None:
            self._finish_stall()
        self._phase = (name, time.perf_counter()) if name is not None else None

    def _finish_stall(self) -> None:
        """On the scheduler thread, as the stalled phase ends: its CPU time and run-queue wait since the watcher
        caught it."""
        stall, before, t = self._pending
        self._pending = None
        after = schedstat(self._tid)
        stall["window_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        if before is not None and after is not None:
            stall["on_cpu_ms"] = round((after[0] - before[0]) / 1e6, 2)
            stall["runq_ms"] = round((after[1] - before[1]) / 1e6, 2)
        stall["cpu_after"] = current_cpu()  # this is the scheduler thread

    def _watch(self, thread: int) -> None:
        import threading

        self.watcher_tid = threading.get_native_id()
        from radixlm.srt.managers.native_stack import code_map

        code_map()  # read the mappings now, not in the first stall (refreshed at each flush)
        seen = None
        while True:
            t = time.perf_counter()
            time.sleep(self.SAMPLE_S)
            # How late this thread got to run again: late with the scheduler thread in a call that let go of
            # the GIL means the process itself was held back (throttled, not scheduled), not that thread.
            self._late = max(self._late, time.perf_counter() - t - self.SAMPLE_S)
            cur = self._phase
            if cur is None or cur is seen or (time.perf_counter() - cur[1]) * 1e3 < self.PHASE_STACK_MS[cur[0]]:
                continue
            seen = cur  # one stack per phase, taken while it lasts
            state, before, t = thread_state(self._tid, True, native=True), schedstat(self._tid), time.perf_counter()
            frame = sys._current_frames().get(thread)
            if frame is not None:
                stack = _stack(frame)
                if self._phase is cur:  # still the same phase: the stack is this stall's
                    self._stacks.append((cur[0], stack))
                    stall = {"phase": cur[0], "at_ms": round((t - cur[1]) * 1e3, 2), **state}
                    self._stalls.append(stall)
                    self._pending = (stall, before, t)
                else:
                    self.missed += 1  # the phase ended while its state was read

    def flush(self) -> None:
        """Write the lines out, with what their stall records need read beside them: this process's mappings
        (`.maps`: which library a futex lies in) and the names of their code addresses (`.syms`). Called at
        quiet moments (/flush_cache, exit): naming addresses takes a while."""
        super().flush()
        if self._addresses and self.path is not None:
            self.path.with_suffix(".maps").write_text(Path("/proc/self/maps").read_text())
            self._addresses = False
        if self._code and self.path is not None:
            from radixlm.srt.managers.native_stack import symbolize

            syms = self.path.with_suffix(".syms")
            known = json.loads(syms.read_text()) if syms.exists() else {}
            addrs, self._code = self._code, set()
            known.update(symbolize(a for a in addrs if f"{a:#x}" not in known))
            syms.write_text(json.dumps(known))

    def record(self, t0: float, info: dict, n_outputs: int) -> None:
        self.phase(None)
        rec = {"t": round(t0, 6), "outputs": n_outputs, **info,
               "gc": sum(g["collections"] for g in gc.get_stats())}
        stacks, self._stacks = self._stacks, []
        if stacks:
            rec["stacks"] = dict(stacks)
        stalls, self._stalls = self._stalls, []
        if stalls:
            rec["stalls"] = stalls
            self._addresses = self._addresses or any("syscall_args" in st for st in stalls)
            for st in stalls:
                self._code |= native_addresses(st)
        if self.missed:
            rec["stalls_missed"], self.missed = self.missed, 0
        late, self._late = self._late, 0.0
        if late > 0.002:
            rec["watch_late_ms"] = round(late * 1e3, 2)
        torch = sys.modules.get("torch")  # not imported here: a benchmark client uses ProcessTrace without it
        if torch is not None and torch.cuda.is_initialized():
            # device mallocs/frees and allocator retries synchronize the host
            m = torch.cuda.memory_stats()
            rec["cuda_alloc"] = [m.get("num_device_alloc", 0), m.get("num_device_free", 0),
                                 m.get("num_alloc_retries", 0)]
        self._add(rec)


class ProcessTrace(_JsonlTrace):
    """An output-path process's trace: `batch(**times)` per batch handled, collector passes (generation, pause)
    from gc.callbacks, and, once `watch_loop()` runs in an asyncio loop, every wake-up over 2 ms late. With no
    path the lines stay in `lines` (a benchmark client keeps them in its own report)."""

    LAG_TICK_S = 0.001
    LAG_REPORT_S = 0.002

    def __init__(self, path: Path | None):
        super().__init__(path)
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, kind: str) -> "ProcessTrace | None":
        path = trace_path(kind)
        return cls(path) if path is not None else None

    def batch(self, **times: float) -> None:
        self._add({"k": "batch", **{k: round(v, 6) if isinstance(v, float) else v for k, v in times.items()}})

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        else:  # appended, never flushed, from inside the collector: no file I/O there
            self.lines.append(json.dumps({"k": "gc", "t": round(self._gc_start, 6), "gen": info["generation"],
                                          "ms": round((now - self._gc_start) * 1e3, 3)}))

    async def watch_loop(self) -> None:
        """Record late wake-ups; a stall long enough for the watcher thread to see it (STALL_STACK_S) carries
        the loop thread's stack as the watcher found it mid-stall, which says what held the loop (a stall with
        no stack: the thread could not run either, e.g. the process was not scheduled)."""
        import asyncio
        import threading

        self._tick = time.perf_counter()
        self._stack: tuple[float, list[str]] | None = None  # (the tick the stall began after, its stack)
        threading.Thread(target=self._watch_stalls, args=(threading.get_ident(),), daemon=True,
                         name="loop-stall-watch").start()
        while True:
            t = time.perf_counter()
            before = self._tick
            await asyncio.sleep(self.LAG_TICK_S)
            self._tick = now = time.perf_counter()
            late = now - t - self.LAG_TICK_S
            caught, self._stack = self._stack, None
            if late > self.LAG_REPORT_S:
                rec = {"k": "lag", "t": round(t, 6), "ms": round(late * 1e3, 3)}
                if caught is not None and caught[0] == before:  # taken during this stall, not a stale one
                    rec["stack"] = caught[1]
                self._add(rec)

    STALL_SAMPLE_S = 0.005
    STALL_STACK_S = 0.015

    def _watch_stalls(self, loop_thread: int) -> None:
        seen = None
        while True:
            time.sleep(self.STALL_SAMPLE_S)
            tick = self._tick
            if tick != seen and time.perf_counter() - tick > self.STALL_STACK_S:
                seen = tick  # one stack per stall, taken while it lasts
                frame = sys._current_frames().get(loop_thread)
                if frame is not None:
                    self._stack = (tick, _stack(frame))
