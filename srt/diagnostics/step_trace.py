"""An opt-in record of the scheduler's steps, for finding where inter-token latency goes.

With RADIXLM_STEP_TRACE=path (see srt/env.py) the scheduler process wraps `Scheduler.step` in `StepTrace`:
one JSON line per step that ran a batch (its start on the monotonic clock, host time in ms, kind, batch size,
tokens, decode riders, outputs), buffered and appended every few hundred steps, on /flush_cache and at exit,
so tracing costs the loop no file I/O in between. With the variable unset nothing here is imported and the
step has no tracing code in it. `benchmarks/itl_tail.py` reads these files beside a client's chunk times.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.srt.managers.io_struct import TokenOutput
    from radixlm.srt.scheduler import Scheduler

_FLUSH_EVERY = 512


def trace_path(target: str) -> Path:
    """A directory gets one file per scheduler process; anything else is the file itself."""
    path = Path(target)
    return path / f"steps-{os.getpid()}.jsonl" if path.is_dir() else path


class StepTrace:
    def __init__(self, path: Path | None):
        self.path = path
        self.lines: list[str] = []
        atexit.register(self.flush)

    def wrap(self, scheduler: Scheduler) -> Callable[[], list[TokenOutput]]:
        """`scheduler.step`, recording each step that ran something."""
        step = scheduler.step

        def traced() -> list[TokenOutput]:
            t0 = time.perf_counter()
            outputs = step()
            ms = (time.perf_counter() - t0) * 1e3
            info = scheduler.last_step
            if info is not None and info.started >= t0:  # this step scheduled a batch
                self.add({"t": t0, "ms": ms, **info.as_dict(), "outputs": len(outputs)})
            elif outputs:  # the previous step's results only (overlap drains its last batch)
                self.add({"t": t0, "ms": ms, "mode": "drain", "outputs": len(outputs)})
            return outputs

        return traced

    def add(self, record: dict) -> None:
        self.lines.append(json.dumps(record))
        if len(self.lines) >= _FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self.lines and self.path is not None:
            with open(self.path, "a") as f:
                f.write("\n".join(self.lines) + "\n")
        self.lines = []
