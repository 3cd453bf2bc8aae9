"""benchmarks/gpu/stall_sampler.py watches a real process's phase board from outside: a phase that runs long
because its thread waits on a mutex another thread holds is caught, with the wait, the holder and the stack."""
import json
import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# A stand-in for the scheduler: quick phases, then a `sample` phase stuck on a mutex a second thread holds for
# 0.3 s, quick phases, a `forward` phase that computes for 0.3 s, quick phases again. It prints the holder's
# thread id.
CHILD = r"""
import ctypes, sys, threading, time
from radixlm.srt.managers.phase_board import PhaseBoard
board = PhaseBoard(sys.argv[1])
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)
held, tids = threading.Event(), {}
def hold():
    tids["holder"] = threading.get_native_id()
    libc.pthread_mutex_lock(mutex); held.set(); time.sleep(0.3); libc.pthread_mutex_unlock(mutex)
def quick(n):
    for _ in range(n):
        for phase in ("schedule", "forward", "sample", "process"):
            board.enter(phase)
        board.enter(None)
        time.sleep(0.001)
time.sleep(0.5)  # the sampler finds the board
quick(50)
t = threading.Thread(target=hold); t.start(); held.wait()
board.enter("sample")
libc.pthread_mutex_lock(mutex); libc.pthread_mutex_unlock(mutex)
board.enter(None)
quick(50)
board.enter("forward")
end = time.monotonic() + 0.3
while time.monotonic() < end:
    sum(range(1000))
board.enter(None)
quick(50)
print(tids["holder"], flush=True)
sys.stdin.read()  # alive until the sampler is done (it names addresses from this process's mappings)
"""


def test_sampler_catches_a_phase_stuck_on_a_mutex(tmp_path):
    board, out = tmp_path / "board", tmp_path / "stalls.json"
    sampler = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/gpu/stall_sampler.py"), str(board),
                                str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(board)], env=ENV, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip(), child.stderr.read()
        holder = int(line)
        time.sleep(0.1)
    finally:
        sampler.send_signal(signal.SIGINT)
        sampler.wait(60)
        child.communicate("", timeout=60)
    assert child.returncode == 0
    got = json.loads(out.read_text())
    assert got["long_phases"] == 2 and got["by_phase"]["sample"] == got["by_phase"]["forward"] == 1  # not quick ones
    first = {r["phase"]: r for r in got["records"] if r["sample"] == 0}
    assert len(first) == 2 and 4 <= len(got["records"]) <= 6  # up to three looks while each lasts
    rec = first["sample"]
    assert rec["phase"] == "sample" and rec["syscall"] == "202" and rec["state"] == "S"
    assert rec["futex_owner"]["tid"] == holder
    assert rec["window_ms"] > 100 and rec["on_cpu_ms"] < rec["window_ms"] / 2  # asleep, not working
    summary = got["summary_first_samples"]
    assert any("pthread_mutex_lock" in stack for stack in summary["native_stacks"])
    assert summary["futex_owners"] and summary["after_caught_ms"]["off_cpu"] > 100
    # Computing: on a CPU, in no system call; stopped for an instant (ptrace) to read where it runs.
    busy = first["forward"]
    assert busy["state"] == "R" and busy["syscall"] == "running" and busy["interrupted"]
    assert busy["on_cpu_ms"] > busy["window_ms"] / 2
    names = [got["syms"].get(a, a) for a in busy["native"]]
    assert any("python" in n.lower() for n in names[:3]), names
