"""Our small C kernels for CPU (q8_gemm.c), compiled on first use and cached.

Plain C called through ctypes, not a torch C++ extension: it needs no torch headers, so it compiles in well
under a second (`gcc -O3 -march=native -fopenmp`), and a warm start only loads the cached .so. The cache key
is the source, the compiler's version and this CPU's flags (the build is -march=native). Without a compiler
the callers keep their torch-op paths (`load()` returns None).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("q8_gemm.c")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(cc: str, out: Path) -> None:
    tmp = tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False)
    tmp.close()
    try:
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", tmp.name, str(_SOURCE)],
                       check=True, capture_output=True, text=True)
        os.replace(tmp.name, out)  # atomic: processes building at once each install a whole file
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where no C compiler works."""
    from radixlm.srt.model_loader.default_model import cache_dir

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.info("no C compiler: the CPU Q8_0 head runs as torch bf16 GEMMs")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(_SOURCE.read_bytes() + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
        out = cache_dir() / "ext" / f"q8_gemm-{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _build(cc, out)
            logger.info("built %s", out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("could not build the CPU Q8_0 kernel (%s); the head runs as torch bf16 GEMMs", detail[-500:])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q8_gemm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.q8_gemm.restype = None
    lib.q8_gemm_avx512.restype = ctypes.c_int
    return lib


def q8_gemm(q: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ (q [N, K] int8 * d [N, K/32] fp32 per block).T -> [M, N] fp32. Needs `load()`."""
    lib = load()
    n, k = q.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.q8_gemm(q.data_ptr(), d.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, x.stride(0), n)
    return y
