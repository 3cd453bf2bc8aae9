"""RADIXLM_STEP_TRACE: the scheduler's step trace and the output path's own traces (detokenizer, tokenizer
manager, benchmark client) line up on one clock, and itl_tail.py reads all of them."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import ROOT
from tests.helpers import ServerProcess

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_output_path_trace_lines_up_with_steps(tmp_path):
    trace = tmp_path / "steps.jsonl"
    srv = ServerProcess("--max-total-tokens", "4096", env={"RADIXLM_STEP_TRACE": str(trace)})
    try:
        client = tmp_path / "run.json"
        # the host probe beside the run, as run_serving.sh runs it on the GPU machine
        probe = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/gpu/host_probe.py"), str(srv.proc.pid),
                                  str(tmp_path / "host.json")], env=ENV, stdout=subprocess.DEVNULL)
        bench = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks/bench_serving.py"), "--base-url", srv.url, "--num-prompts", "4",
             "--max-concurrency", "2", "--input-len", "16", "--output-len", "8", "--save-chunk-times",
             "--out", str(client)], env=ENV, capture_output=True,
            text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-2000:]
        probe.send_signal(signal.SIGINT)
        assert probe.wait(timeout=30) == 0
        # /flush_cache is the quiet moment at which the scheduler and tokenizer manager write their buffers out
        assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200
    finally:
        assert srv.stop() == 0

    steps = _lines(trace)
    tok = [e for e in _lines(tmp_path / "steps.tokenizer.jsonl") if e["k"] == "batch"]
    det = [e for e in _lines(tmp_path / "steps.detokenizer.jsonl") if e["k"] == "batch"]
    report = json.loads(client.read_text())
    assert report["completed"] == 4 and len(report["chunk_times"]) == 4
    assert isinstance(report["client_events"], list)
    # the client's CPU guard reports where its loop may run (every CPU unless it moved) and its moves
    allowed = report["client_cpu"]["allowed_now"]
    assert allowed and isinstance(report["client_cpu"]["moves"], list)
    # every batch went scheduler -> detokenizer -> tokenizer manager, in that order on the shared clock
    assert det and tok
    for e in det:
        assert e["sched"] <= e["recv"] <= e["sent"]
    for e in tok:
        assert 0 < e["sched"] <= e["detok"] <= e["recv"]
    assert {e["sched"] for e in tok} <= {e["sched"] for e in det}
    # tokens reach the tokenizer manager after the step that sampled them began, and clients after that
    first_step = min(s["t"] for s in steps)
    assert min(e["sched"] for e in tok) > first_step
    assert sum(e["n"] for e in tok) >= sum(len(t) - 1 for t in report["chunk_times"])

    host = json.loads((tmp_path / "host.json").read_text())
    # the server's three processes (HTTP + tokenizer, scheduler, detokenizer), and the run kept the machine busy
    assert srv.proc.pid in {p["pid"] for p in host["server"]} and len(host["server"]) >= 3
    assert host["seconds"] > 0 and sum(p["cpu"] for p in host["server"]) > 0 and host["machine_busy_cpus"] > 0
    assert set(host["machine_share"]) >= {"user", "system", "idle", "steal"}

    out = tmp_path / "tail.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/itl_tail.py"), str(trace), str(client),
                          "--out", str(out)], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    tail = json.loads(out.read_text())
    hops = tail["output_path"]["hops_ms"]
    assert set(hops) == {"scheduler->detokenizer", "detokenizer work", "detokenizer->tokenizer",
                         "scheduler->tokenizer"}
    assert all(h["p50"] >= 0 and h["max"] >= h["p50"] for h in hops.values())
    assert sum(tail["classes"].values()) == tail["slow_gaps"]
    assert sum(tail["delivery_blame"].values()) >= tail["classes"].get("delivery", 0)


def _block_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous call inside a request handler does to every other stream


def test_loop_stall_carries_the_stack_that_held_it():
    """A wake-up 100 ms late is recorded with the loop thread's stack as the watcher saw it mid-stall."""
    from radixlm.srt.managers.step_trace import ProcessTrace

    trace = ProcessTrace(None)

    async def run():
        watch = asyncio.ensure_future(trace.watch_loop())
        await asyncio.sleep(0.05)
        _block_the_loop(0.1)
        await asyncio.sleep(0.05)
        watch.cancel()

    asyncio.run(run())
    lags = [json.loads(line) for line in trace.lines if '"lag"' in line]
    stalled = [r for r in lags if r["ms"] > 80]
    assert stalled and any("_block_the_loop" in frame for frame in stalled[0].get("stack", []))


def _stall_in_sample(trace, until: float) -> None:
    trace.phase("sample")
    while not trace._stacks and time.monotonic() < until:  # a long phase: wait (GIL released) for the watcher
        time.sleep(0.005)


def test_long_scheduler_phase_carries_its_stack():
    """A phase past its usual length gets the scheduler thread's stack in that step's line; short ones do not."""
    from radixlm.srt.managers.step_trace import StepTrace

    trace = StepTrace(None)
    trace.phase("schedule")  # well under its 3 ms
    trace.record(time.perf_counter(), {"mode": "decode"}, 0)
    _stall_in_sample(trace, time.monotonic() + 5)
    time.sleep(0.05)  # the stall goes on after the watcher caught it
    trace.record(time.perf_counter(), {"mode": "decode"}, 1)
    quick, slow = (json.loads(line) for line in trace.lines)
    assert "stacks" not in quick and "stalls" not in quick
    assert list(slow["stacks"]) == ["sample"] and "_stall_in_sample" in slow["stacks"]["sample"][-1]
    # The thread slept through the stall: the kernel saw it asleep, and off a CPU for most of what followed.
    (stall,) = slow["stalls"]
    assert stall["phase"] == "sample" and stall["at_ms"] >= StepTrace.PHASE_STACK_MS["sample"]
    assert stall["state"] in ("S", "R") and stall["syscall"] and stall["wchan"]
    assert stall["window_ms"] >= 40 and stall["on_cpu_ms"] < stall["window_ms"] / 2 and stall["runq_ms"] >= 0
    # with the other threads of the process as they were then: the watcher itself (on a CPU, reading /proc)
    watcher = [t for t in stall["threads"] if t[0] == trace.watcher_tid]
    assert watcher and watcher[0][2] == "R" and watcher[0][3] in ("running", "0")
    if stall["syscall"] != "running":  # asleep in a system call: its arguments are there (a futex: the address)
        assert len(stall["syscall_args"]) == 2 and stall["syscall_args"][0].startswith("0x")


def test_stall_summary_splits_caught_time_by_where_the_thread_was():
    from benchmarks.itl_tail import stall_summary

    got = stall_summary([
        {"state": "S", "syscall": "16", "wchan": "x", "cpu": 3, "cpu_after": 3, "window_ms": 10.0,
         "on_cpu_ms": 2.0, "runq_ms": 1.0},
        {"state": "R", "syscall": "running", "wchan": "-", "cpu": 3, "cpu_after": 5, "window_ms": 6.0,
         "on_cpu_ms": 6.0, "runq_ms": 0.0},
        {"state": "S", "syscall": "202", "wchan": "futex_wait_queue"}])  # its phase never ended in the trace
    assert got["caught"] == 3 and got["moved_cpu"] == 1
    assert got["after_caught_ms"] == {"window": 16.0, "on_cpu": 8.0, "runq": 1.0, "off_cpu": 7.0}
    assert got["state_syscall_wchan"] == {"S ioctl x": 1, "R running -": 1, "S futex futex_wait_queue": 1}


def test_stall_summary_names_the_lock_and_who_else_ran():
    from benchmarks.itl_tail import mapping_of, stall_summary

    maps = ("7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n"
            "7f0000100000-7f0000200000 rw-p 00100000 08:01 42 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
            "55aa00000000-55aa00021000 rw-p 00000000 00:00 0                          [heap]\n")
    assert mapping_of(0x7f0000100010, maps) == "libcuda.so.1" and mapping_of(0x7f0000000008, maps) == "anon"
    assert mapping_of(0x55aa00000100, maps) == "[heap]" and mapping_of(0x10, maps) == "unmapped"
    stalls = [{"state": "S", "syscall": "202", "syscall_args": ["0x7f0000100010", "0x80"],
               "threads": [[2, "cuda-EvtHandlr", "R", "running", 3], [3, "ZMQbg/IO/0", "S", "232", 5]]},
              {"state": "S", "syscall": "202", "syscall_args": ["0x7f0000100010", "0x80"], "threads": []},
              {"state": "R", "syscall": "running", "kstack": ["a+0x1/0x2", "b+0x3/0x4"]}]
    got = stall_summary(stalls, maps)
    assert got["futex_in"] == {"libcuda.so.1": 2}
    assert got["others_running"] == {"cuda-EvtHandlr running": 1}
    assert got["kernel_stacks"] == {"a+0x1/0x2 < b+0x3/0x4": 1}
    assert stall_summary(stalls)["futex_in"] == {"0x7f0000100010": 2}  # no mappings: the raw address


def test_a_stall_with_an_address_leaves_the_mappings_beside_the_trace(tmp_path):
    from radixlm.srt.managers.step_trace import StepTrace

    trace = StepTrace(tmp_path / "steps.jsonl")
    trace.record(time.perf_counter(), {"mode": "decode"}, 0)
    trace.flush()
    assert not (tmp_path / "steps.maps").exists()  # no stall, no copy
    trace._stalls.append({"phase": "sample", "syscall": "202", "syscall_args": ["0x7f00", "0x80"]})
    trace.record(time.perf_counter(), {"mode": "decode"}, 1)
    trace.flush()
    maps = (tmp_path / "steps.maps").read_text()
    assert "python" in maps.lower() or "libpython" in maps  # this process's own mappings
    assert json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[1])["stalls"][0]["syscall_args"]


def test_a_thread_stalled_on_a_mutex_names_its_holder_and_native_stacks(tmp_path):
    """A real pthread mutex held by one thread and waited on by another: the waiter's state carries a native
    stack guess (raw addresses, named at the trace's flush) with the libc call it sleeps in, and the holder
    found from the mutex's owner field."""
    import ctypes
    import threading

    from benchmarks.itl_tail import stall_summary
    from radixlm.srt.managers.step_trace import StepTrace, thread_state

    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: an unlocked default mutex
    tids, held, release = {}, threading.Event(), threading.Event()

    def hold():
        tids["holder"] = threading.get_native_id()
        libc.pthread_mutex_lock(mutex)  # ctypes lets go of the GIL around foreign calls
        held.set()
        release.wait()
        libc.pthread_mutex_unlock(mutex)

    def wait():
        tids["waiter"] = threading.get_native_id()
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_unlock(mutex)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (
                "waiter" in tids and open(f"/proc/self/task/{tids['waiter']}/syscall").read().startswith("202")):
            time.sleep(0.001)
        t = time.perf_counter()
        state = thread_state(tids["waiter"], others=True, native=True)
        took = time.perf_counter() - t
    finally:
        release.set()
        holder.join()
        waiter.join()
    assert took < 0.5  # no symbol lookups while a stall lasts (a rough bound: CI machines are slow)
    assert state["syscall"] == "202" and all(a.startswith("0x") for a in state["native"])
    owner = state["futex_owner"]
    assert owner["tid"] == tids["holder"] and owner["state"] == "S"
    # the trace names the addresses when it is flushed, beside the mappings
    trace = StepTrace(tmp_path / "steps.jsonl")
    trace._stalls.append(state)
    trace.record(time.perf_counter(), {"mode": "decode"}, 0)
    trace.flush()
    syms = json.loads((tmp_path / "steps.syms").read_text())
    assert (tmp_path / "steps.maps").exists()
    assert any(syms[a].startswith("libc.so.6!pthread_mutex_lock+") for a in state["native"][:3])
    got = stall_summary([state], syms=syms)
    (stack,) = got["native_stacks"]
    assert "pthread_mutex_lock" in stack
    (who,) = got["futex_owners"]
    assert who.startswith("python S futex: ") and "PyThread_acquire_lock" in who


def test_native_stack_guess_reads_only_mapped_memory():
    import ctypes
    import threading

    from radixlm.srt.managers.native_stack import code_map, read_memory, stack_guess, symbolize

    code = code_map()
    # a thread reading its own /proc entry is in read() as the kernel answers
    (pc, *_) = stack_guess(threading.get_native_id(), code)
    name = symbolize([pc], code)[f"{pc:#x}"]
    assert name.startswith("libc.so.6!") and "read+" in name
    assert read_memory(8, 32) == b""  # the zero page is not mapped: an empty read, not a crash
    buf = ctypes.create_string_buffer(b"radixlm", 16)
    assert read_memory(ctypes.addressof(buf), 7) == b"radixlm"
    assert code.find(ctypes.addressof(buf)) is None and symbolize([ctypes.addressof(buf)], code) == {}  # data
