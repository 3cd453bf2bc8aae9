"""`triton` and `triton.language` when installed, else stand-ins that let kernel modules import (their
`@triton.jit` functions are then never launched)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

from radixlm.srt import env

try:
    import triton
    import triton.language as tl
except ImportError:

    class _Stub:
        constexpr = int

        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a, b):
            return -(-a // b)

    triton = tl = _Stub()

try:  # programmatic dependent launch (Hopper+): griddepcontrol.wait / .launch_dependents
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

_PDL: dict = {}


def pdl_enabled(device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: a kernel may then start (and
    stream the weights it will need) while the one before it finishes, and waits (`gdc_wait`) only before it
    reads that kernel's output. Hopper or newer, real CUDA (not the interpreter); RADIXLM_PDL=0 turns it off."""
    key = getattr(device, "index", None)
    if key not in _PDL:
        import torch

        _PDL[key] = (
            gdc_wait is not None
            and env.PDL.get()
            and not env.TRITON_INTERPRET.get()
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9
        )
    return _PDL[key]


def pdl_args(device) -> dict:
    """Launch arguments for a kernel with a `USE_PDL` constexpr that, when set, waits (`gdc_wait`) before it
    reads anything the kernels before it write. Every program of such a kernel must reach `gdc_wait` before it
    ends (no early return ahead of it): a kernel's completion then means the kernels before it completed, which
    kernels that count calls on the device rely on (kernels/allreduce_norm.py's epoch)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


_COMPILE_ONLY: ContextVar[bool] = ContextVar("radixlm_compile_only", default=False)


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`; inside `compile_ahead`, only the compile of that launch's specialization
    (queued on the compile threads), nothing run."""
    if _COMPILE_ONLY.get():
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def compile_ahead(calls: Iterable[Callable[[], object]], workers: int | None = None) -> tuple[int, float] | None:
    """Compile what each call would launch through `launch`, on `workers` threads at once (Triton's asynchronous
    compile mode; its passes and ptxas run outside the GIL), without running those kernels (one a call launches
    directly, such as fp8_mm's activation quantization, runs as usual): a tuner about to time many configs then
    finds them compiled, instead of compiling one at its first launch after another. A config that
    cannot be built raises again at its real launch, where the caller handles it. Returns (calls made, seconds),
    or None where this Triton has no asynchronous compile mode (kernels then compile at their first launch)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: PLC0415
    except ImportError:
        return None
    from radixlm.srt.cpu_threads import usable_cpus  # noqa: PLC0415 - the cgroup's share, not the host's cores

    t0, made = time.perf_counter(), 0
    token = _COMPILE_ONLY.set(True)
    try:
        # the mode's exit waits for every compile and installs the kernels; the pool closes after it
        with (
            ThreadPoolExecutor(workers or min(32, usable_cpus())) as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            for call in calls:
                try:
                    call()
                    made += 1
                except Exception:  # noqa: BLE001, S112 - built (and reported) at its real launch instead
                    continue
    finally:
        _COMPILE_ONLY.reset(token)
    return made, time.perf_counter() - t0


__all__ = [
    "triton",
    "tl",
    "gdc_launch_dependents",
    "gdc_wait",
    "pdl_enabled",
    "pdl_args",
    "launch",
    "compile_ahead",
]
