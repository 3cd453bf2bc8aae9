"""Optional per-step trace of the scheduler, for finding where inter-token latency tails come from.

Set RADIXLM_STEP_TRACE=path (a file, or a directory to get one file per scheduler process) and the scheduler
appends one JSON line per step: start time, kind, batch size, tokens, decode riders, outputs and its host
phases, the cyclic collector's pass count and, on CUDA, the caching allocator's device malloc / free / retry
counts (cumulative: a step whose counts moved paid for a device sync). Lines are buffered and written every
few hundred steps, on /flush_cache and at exit, so tracing costs the step loop no file I/O in between.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
from pathlib import Path

import torch


class StepTrace:
    FLUSH_EVERY = 512

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []
        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        target = os.environ.get("RADIXLM_STEP_TRACE")
        if not target:
            return None
        path = Path(target)
        if path.is_dir():
            path = path / f"steps-{os.getpid()}.jsonl"
        return cls(path)

    def record(self, t0: float, info: dict, n_outputs: int) -> None:
        rec = {"t": round(t0, 6), "outputs": n_outputs, **info,
               "gc": sum(g["collections"] for g in gc.get_stats())}
        if torch.cuda.is_initialized():  # device mallocs/frees and allocator retries synchronize the host
            m = torch.cuda.memory_stats()
            rec["cuda_alloc"] = [m.get("num_device_alloc", 0), m.get("num_device_free", 0),
                                 m.get("num_alloc_retries", 0)]
        self.lines.append(json.dumps(rec))
        if len(self.lines) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
            self.lines = []
