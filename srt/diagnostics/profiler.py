"""A torch.profiler run in the scheduler process, started and stopped over HTTP (`POST /start_profile` and
`/stop_profile`, as SGLang names them): the steps that run in between are recorded, then written out as a
Chrome trace (open it in Perfetto or chrome://tracing) and a table of the operators and kernels by their own
time.
Rank 0 is profiled (it schedules and runs its share of every step); the other tensor-parallel ranks are not.

Imported only when a profile is asked for; the step loop then calls `step()` once a step, which costs nothing
while no profile runs. A profile without `num_steps` keeps every event in memory until it is stopped, and
writing it out holds the scheduler for as long as that takes: profile a bounded stretch of work.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from radixlm.srt import env

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "CUDA")  # GPU and CUDA are the same thing: kernels on the device
_SUMMARY_ROWS = 60


class ProfileError(ValueError):
    """A start or stop the scheduler refuses (already running, nothing running, an unusable argument)."""


class StepProfiler:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self._prof: torch.profiler.profile | None = None
        self._num_steps: int | None = None  # the running profile ends itself after this many steps
        self._out: Path | None = None
        self._started = 0.0
        self._steps = 0  # steps recorded by the running profile
        # a profile that stopped itself after num_steps: where it went, or why it could not be written
        self._unreported: dict | ProfileError | None = None

    def start(
        self, output_dir: str | None, num_steps: int | None, activities: list[str] | None, record_shapes: bool
    ) -> dict:
        """`output_dir` None: RADIXLM_TORCH_PROFILER_DIR, else /tmp."""
        output_dir = output_dir or env.TORCH_PROFILER_DIR.get() or "/tmp"
        if self._prof is not None:
            raise ProfileError("a profile is already running: POST /stop_profile first")
        acts = _activities(activities)
        out = Path(output_dir).expanduser()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProfileError(f"output_dir {output_dir!r} cannot be created: {e.strerror or e}") from None
        if not os.access(out, os.W_OK):
            raise ProfileError(f"output_dir {output_dir!r} is not writable by the server")
        prof = torch.profiler.profile(activities=acts, record_shapes=record_shapes)
        try:
            prof.start()
        except Exception as e:  # noqa: BLE001 - e.g. CUPTI refusing: the caller's error, never the loop's
            raise ProfileError(f"the profiler did not start: {type(e).__name__}: {e}") from None
        self._prof, self._num_steps, self._out, self._started = prof, num_steps, out, time.time()
        self._steps = 0
        self._unreported = None
        return {"output_dir": str(out), "num_steps": num_steps, "activities": [a.name for a in acts]}

    def step(self) -> None:
        """After each scheduler step that ran: counts it, and after `num_steps` writes the profile out."""
        if self._prof is None:
            return
        self._steps += 1
        if self._num_steps is not None and self._steps >= self._num_steps:
            try:
                self._unreported = self._write()
            except ProfileError as e:  # kept for /stop_profile to report; the scheduler goes on
                logger.error("%s", e)
                self._unreported = e

    def stop(self) -> dict:
        """Ends the profile and writes it out; after one that stopped itself (num_steps), says where it went."""
        if self._prof is None:
            if self._unreported is not None:
                done, self._unreported = self._unreported, None
                if isinstance(done, ProfileError):
                    raise done
                return done
            raise ProfileError("no profile is running: POST /start_profile first")
        return self._write()

    def _write(self) -> dict:
        prof, out = self._prof, self._out
        self._prof = self._num_steps = self._out = None
        # the start to the millisecond and the process: two profiles (or two replicas) never share a name
        started = time.strftime("%Y%m%d-%H%M%S", time.localtime(self._started))
        stem = f"radixlm-{started}-{int(self._started * 1000) % 1000:03d}-pid{os.getpid()}-rank{self.rank}"
        trace, summary = out / f"{stem}.trace.json.gz", out / f"{stem}.summary.txt"
        try:
            prof.stop()
            prof.export_chrome_trace(str(trace))
            events = prof.key_averages()
            # kernels by their own time (a parent operator's total would count its kernels again)
            device = any(getattr(e, "self_device_time_total", 0) for e in events)
            key = "self_device_time_total" if device else "self_cpu_time_total"
            summary.write_text(events.table(sort_by=key, row_limit=_SUMMARY_ROWS) + "\n")
        except Exception as e:  # noqa: BLE001 - a full disk or a removed directory: the caller's error
            raise ProfileError(f"the profile could not be written to {str(out)!r}: {type(e).__name__}: {e}") from None
        seconds = round(time.time() - self._started, 3)
        return {"trace": str(trace), "summary": str(summary), "steps": self._steps, "seconds": seconds}


def _activities(names: list[str] | None) -> list[torch.profiler.ProfilerActivity]:
    """The profiler's activities: the CPU, and the device's kernels where there is one (default), or as asked."""
    cuda = torch.cuda.is_available()
    if not names:
        names = ["CPU", "GPU"] if cuda else ["CPU"]
    acts = []
    for name in names:
        if name not in ACTIVITIES:
            raise ProfileError(f"unknown activity {name!r}; expected some of CPU, GPU (or CUDA)")
        if name == "CPU":
            act = torch.profiler.ProfilerActivity.CPU
        elif cuda:
            act = torch.profiler.ProfilerActivity.CUDA
        else:
            raise ProfileError(f"activity {name!r} needs a CUDA device; this server runs on the CPU")
        if act not in acts:
            acts.append(act)
    return acts
