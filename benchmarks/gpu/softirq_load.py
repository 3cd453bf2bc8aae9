"""Softirq load on the CPU the server's scheduler loop runs on, to reproduce the lent VMs' c32 latency tail.

On some of those machines CPU 0 lost 15-40% of its time to softirqs while the scheduler loop sat there, and
decode steps stalled 5-15 ms. This finds the server's busiest thread (the scheduler loop, about one CPU),
pins itself to that thread's CPU, and streams over loopback TCP: the kernel delivers loopback packets in
softirq context on the sending CPU, so that CPU loses time the way the VMs' CPU 0 did. It stays on that CPU
for the whole run (as the VMs' load did) and stops on SIGINT or after SECONDS.

    python benchmarks/gpu/softirq_load.py --pid SERVER_PID [--seconds S]   # the server's busiest thread's CPU
    python benchmarks/gpu/softirq_load.py --cpu N [--seconds S]            # a given CPU
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: radixlm's stdlib-only helpers
from radixlm.srt.utils import read_proc_stat  # noqa: E402


def busiest_thread(root: int, window: float = 0.5) -> tuple[int, int]:
    """(tid, CPU it runs on) of the thread in `root`'s process tree that used the most CPU over `window`."""
    def threads() -> dict[int, tuple[int, int]]:
        out = {}
        pids = [root] + [int(p) for p in _children(root)]
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    rest = read_proc_stat(f"/proc/{pid}/task/{tid}/stat")[1]
                except OSError:
                    continue
                out[int(tid)] = (int(rest[11]) + int(rest[12]), int(rest[36]))
        return out
    before = threads()
    time.sleep(window)
    after = threads()
    tid = max(after, key=lambda t: after[t][0] - before.get(t, (after[t][0], 0))[0])
    return tid, after[tid][1]


def _children(pid: int) -> list[str]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            found += [kid] + _children(int(kid))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--pid", type=int, help="load the CPU of this process tree's busiest thread")
    where.add_argument("--cpu", type=int, help="load this CPU")
    ap.add_argument("--seconds", type=float, default=3600.0)
    args = ap.parse_args()
    if args.cpu is not None:
        cpu, why = args.cpu, "as asked"
    else:
        tid, cpu = busiest_thread(args.pid)
        why = f"the server's busiest thread, {tid}, runs there"
    secs = args.seconds
    os.sched_setaffinity(0, {cpu})  # before the sink thread starts: it inherits the CPU
    print(f"softirq load on CPU {cpu} ({why})", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def sink() -> None:
        conn, _ = srv.accept()
        while conn.recv(1 << 20):
            pass

    threading.Thread(target=sink, daemon=True).start()
    out = socket.create_connection(srv.getsockname())
    chunk, end = b"x" * 65536, time.monotonic() + secs
    while not stop.is_set() and time.monotonic() < end:
        out.sendall(chunk)


if __name__ == "__main__":
    main()
