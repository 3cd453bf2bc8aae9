"""Every environment variable the runtime reads, declared once: name, type, default and what it does.

Server behaviour is configured through ServerArgs (flags); the variables here are for what must be known before
any flag is parsed (where the cache lives, what OpenMP does when torch loads), for tools around the runtime
(the step trace) and for the external tools whose own variables we honour (Triton's interpreter, the C
compiler, OpenMP). Read them through these objects, never with os.environ directly: `python -m radixlm.srt.env`
lists them with their current values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if raw is None or raw == "" else self.parse(raw)

    def is_set(self) -> bool:
        return self.name in os.environ

    def set_default(self, value: str) -> bool:
        """Set the variable for this process (and the ones it starts) unless already set; True if set here."""
        if self.is_set():
            return False
        os.environ[self.name] = value
        return True


# --- radixlm's own ----------------------------------------------------------------------------------------------
CACHE_DIR = EnvVar(
    "RADIXLM_CACHE_DIR",
    "",
    str,
    "where the embedded model and the compiled CPU kernels are cached (default ~/.cache/radixlm)",
)
STEP_TRACE = EnvVar(
    "RADIXLM_STEP_TRACE",
    "",
    str,
    "a file (or a directory: one file per scheduler process) "
    "that gets one JSON line per scheduler step (srt/diagnostics/step_trace.py); off when empty",
)
TORCH_PROFILER_DIR = EnvVar(
    "RADIXLM_TORCH_PROFILER_DIR",
    "",
    str,
    "where POST /start_profile writes its trace and summary unless the request names output_dir (default /tmp)",
)
PDL = EnvVar(
    "RADIXLM_PDL",
    True,
    _flag,
    "programmatic dependent launch for our Triton kernels on Hopper "
    "(a kernel starts while the one before it finishes); 0 turns it off, e.g. to rule it out of a bug",
)

# --- external tools' variables that we read or set --------------------------------------------------------------
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET", False, _flag, "run Triton kernels in Triton's interpreter on the CPU (how CI tests them)"
)
CC = EnvVar("CC", "", str, "the C compiler for the CPU kernels (default gcc, else cc)")
OMP_NUM_THREADS = EnvVar(
    "OMP_NUM_THREADS",
    "",
    str,
    "threads of a CPU forward; unset, we use the CPUs this process may use (affinity and cgroup quota)",
)
OMP_WAIT_POLICY = EnvVar(
    "OMP_WAIT_POLICY",
    "",
    str,
    "how idle OpenMP threads wait; unset (and GOMP_SPINCOUNT "
    "unset), we set PASSIVE before torch loads, so a shared CPU does not collapse",
)
GOMP_SPINCOUNT = EnvVar("GOMP_SPINCOUNT", "", str, "GNU OpenMP's spin count; when set, we leave OMP_WAIT_POLICY alone")

ALL: tuple[EnvVar, ...] = (
    CACHE_DIR,
    STEP_TRACE,
    TORCH_PROFILER_DIR,
    PDL,
    TRITON_INTERPRET,
    CC,
    OMP_NUM_THREADS,
    OMP_WAIT_POLICY,
    GOMP_SPINCOUNT,
)

if __name__ == "__main__":
    for var in ALL:
        print(f"{var.name}={os.environ.get(var.name, '')!s:<12} {var.help}")
