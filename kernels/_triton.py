"""`triton` and `triton.language` when installed, else stand-ins that let kernel modules import (their
`@triton.jit` functions are then never launched)."""

from __future__ import annotations

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
    reads anything the kernels before it write."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}


__all__ = ["triton", "tl", "gdc_launch_dependents", "gdc_wait", "pdl_enabled", "pdl_args"]
