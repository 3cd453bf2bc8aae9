"""How late does the host learn that the device is done? A decode step that runs one at a time ends when the host
holds its sampled ids, so the time from the device's last copy to the host's wake-up is part of every such step.

For each way of waiting, N times: the device idles, the host records a start event, queues a sleep kernel of
about 5 ms, a small device->pinned copy and an end event, then waits. The device's span (start event to end
event) is subtracted from the host's (before the start record to after the wait): what is left is the launch
latency plus the wake-up latency. A bare round trip (record, wait, no work) is timed too.

    python benchmarks/gpu/wake_latency.py [--out wake.json]

On the H100 machine (2026-11-24): cudaEventSynchronize woke 25 us after the device's end (the bare round trip
29 us), polling the event 23 us, a blocking-sync event 200 us; a batch-1 step waiting by polling was no faster
than by synchronize (5.90/5.91 vs 5.77 ms in one run), so the runtime keeps cudaEventSynchronize.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def waits():
    def event_sync(e):
        e.synchronize()

    def query_poll(e):
        while not e.query():
            pass

    def query_poll_sleep0(e):
        while not e.query():
            time.sleep(0)

    def stream_sync(e):
        torch.cuda.current_stream().synchronize()

    def device_sync(e):
        torch.cuda.synchronize()

    return {"event.synchronize": (event_sync, False), "blocking event.synchronize": (event_sync, True),
            "event.query poll": (query_poll, False), "event.query poll + sleep(0)": (query_poll_sleep0, False),
            "stream.synchronize": (stream_sync, False), "torch.cuda.synchronize": (device_sync, False)}


def measure(wait, blocking: bool, cycles: int, reps: int) -> dict:
    src = torch.arange(64, device="cuda", dtype=torch.int64)
    dst = torch.empty(64, dtype=torch.int64, pin_memory=True)
    lat, bare = [], []
    for i in range(reps + 3):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True, blocking=blocking)
        t0 = time.perf_counter()
        start.record()
        if cycles:
            torch.cuda._sleep(cycles)
        dst.copy_(src, non_blocking=True)
        end.record()
        wait(end)
        host = time.perf_counter() - t0
        if i >= 3:
            lat.append((host - start.elapsed_time(end) / 1e3) * 1e6)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        done = torch.cuda.Event(blocking=blocking)
        done.record()
        wait(done)
        if i >= 3:
            bare.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    return {"host_minus_device_us_p50": round(statistics.median(lat), 1), "p90": round(lat[int(0.9 * len(lat))], 1),
            "bare_round_trip_us_p50": round(statistics.median(bare), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out")
    args = ap.parse_args()
    # Calibrate the sleep kernel to about 5 ms (a batch-1 decode step's length).
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    e0.record()
    torch.cuda._sleep(1_000_000)
    e1.record()
    e1.synchronize()
    cycles = int(1_000_000 * 5.0 / e0.elapsed_time(e1))
    rows = {name: measure(fn, blocking, cycles, args.reps) for name, (fn, blocking) in waits().items()}
    print(f"{'wait':32} {'host - device us p50':>22} {'p90':>8} {'bare round trip us':>20}")
    for name, r in rows.items():
        print(f"{name:32} {r['host_minus_device_us_p50']:22.1f} {r['p90']:8.1f} {r['bare_round_trip_us_p50']:20.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sleep_cycles": cycles, "waits": rows}, f, indent=1)


if __name__ == "__main__":
    main()
