"""Our C kernels for CPU decode (cpu_kernels.c), compiled on first use and cached, each beside its torch
reference.

Plain C called through ctypes, not a torch C++ extension: it needs no torch headers, so it compiles in about a
second (`gcc -O3 -march=native -fopenmp`), a warm start only loads the cached .so, and a call costs ~1-3 us
against several us per torch op. The cache key is the source, the compiler's version and this CPU's flags (the
build is -march=native). Without a C compiler `load()` returns None and callers keep their torch-op paths.
Tensors passed in must be contiguous where the C side says so; the wrappers check what they cannot assume.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from radixlm.srt import env

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "q8_gemm": [_ptr] * 4 + [_i64] * 5,
    "add_rmsnorm": [_ptr, _ptr, _int, _ptr, _f32, _i64, _i64, _ptr, _int],
    "rope_store": [_ptr, _int, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr] + [_i64] * 4,
    "decode_attention": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr] + [_i64] * 4 + [_f32, _i64],
    "silu_mul_bf16": [_ptr, _ptr, _i64, _i64],
    "q4_gemm": [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64],
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(cc: str, flags: list[str], out: Path) -> None:
    tmp = tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False)
    tmp.close()
    try:
        subprocess.run([cc, *flags, "-o", tmp.name, str(_SOURCE), "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp.name, out)  # atomic: processes building at once each install a whole file
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where no C compiler works."""
    return build_variant(())


@lru_cache(maxsize=None)
def build_variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built with `extra_flags` after ours (tests build a `-mno-avx512f` one to run the portable
    code paths on this machine too)."""
    from radixlm.srt.model_loader.default_model import cache_dir

    cc = env.CC.get() or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.info("no C compiler: CPU decode runs on torch ops only")
        return None
    flags = _FLAGS + list(extra_flags)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(
            _SOURCE.read_bytes() + " ".join(flags).encode() + version.encode() + _cpu_flags().encode()
        ).hexdigest()[:16]
        out = cache_dir() / "ext" / f"cpu_kernels-{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            _build(cc, flags, out)
            logger.info("built %s", out)
        lib = ctypes.CDLL(str(out))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("could not build the CPU kernels (%s); CPU decode runs on torch ops only", detail[-500:])
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.q8_gemm_avx512.restype = ctypes.c_int
    lib.q4_gemm_available.restype = ctypes.c_int
    lib.q4_gemm_isa.restype = ctypes.c_int
    return lib


def describe() -> str:
    """Which CPU kernels run, for the start-up log."""
    lib = load()
    if lib is None:
        return "torch ops (no C compiler)"
    isa = q4_isa()
    if isa == "AVX-512 BF16":
        return "our C kernels (AVX-512 BF16)"
    if isa == "AVX2":
        return "our C kernels (AVX-512; Q4 on AVX2)" if lib.q8_gemm_avx512() else "our C kernels (AVX2)"
    return "our C kernels (AVX-512)" if lib.q8_gemm_avx512() else "our C kernels (portable C)"


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not (t.is_cpu and t.is_contiguous()):
            raise ValueError(f"expected a contiguous CPU tensor, got {tuple(t.shape)} strides {t.stride()}")


# --- x @ W.T on Q8_0 blocks ----------------------------------------------------------------------------------
def q8_gemm(q: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ (q [N, K] int8 * d [N, K/32] fp32 per block).T -> [M, N] fp32."""
    n, k = q.shape
    _check(q, d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    load().q8_gemm(q.data_ptr(), d.data_ptr(), x.data_ptr(), y.data_ptr(), x.shape[0], n, k, x.stride(0), n)
    return y


def q8_gemm_ref(q: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.float() @ (q.view(q.shape[0], -1, 32).float() * d.unsqueeze(-1)).view(q.shape).T


# --- RMSNorm with the residual add ---------------------------------------------------------------------------
def add_rmsnorm(
    residual: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """residual [T, H] fp32 += add (bf16 or fp32, same shape), in place; returns rmsnorm(residual) * weight
    in `out_dtype` (bf16 or fp32)."""
    t, h = residual.shape
    _check(residual, weight, *(() if add is None else (add,)))
    out = torch.empty(t, h, dtype=out_dtype)
    load().add_rmsnorm(
        residual.data_ptr(),
        None if add is None else add.data_ptr(),
        add is not None and add.dtype == torch.bfloat16,
        weight.data_ptr(),
        eps,
        t,
        h,
        out.data_ptr(),
        out_dtype == torch.bfloat16,
    )
    return out


def add_rmsnorm_ref(residual, add, weight, eps, out_dtype):
    if add is not None:
        residual += add
    return torch.rms_norm(residual, (residual.shape[-1],), weight, eps).to(out_dtype)


# --- rope + KV store -----------------------------------------------------------------------------------------
def rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    h: int,
    kvh: int,
    d: int,
) -> torch.Tensor:
    """qkv [T, (h + 2 kvh) d] (bf16 or fp32, unit stride in the last dim): rotates q and k (rotate-half, by
    cos_sin [P, d] = cos | sin), writes k and v into the fp32 caches [slots, kvh, d] at `loc`; returns q
    [T, h, d] fp32."""
    t = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    _check(positions, cos_sin, k_cache, v_cache, loc)
    q = torch.empty(t, h, d, dtype=torch.float32)
    load().rope_store(
        qkv.data_ptr(),
        qkv.dtype == torch.bfloat16,
        qkv.stride(0),
        positions.data_ptr(),
        cos_sin.data_ptr(),
        cos_sin.stride(0),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        loc.data_ptr(),
        t,
        h,
        kvh,
        d,
    )
    return q


def rope_store_ref(qkv, positions, cos_sin, k_cache, v_cache, loc, h, kvh, d):
    t, half = qkv.shape[0], d // 2
    x = qkv.float()
    qk = x[:, : (h + kvh) * d].reshape(t, h + kvh, d)
    cs = cos_sin.index_select(0, positions).unsqueeze(1)
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = qk[..., :half], qk[..., half:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    k_cache.index_copy_(0, loc, rot[:, h:].contiguous())
    v_cache.index_copy_(0, loc, x[:, (h + kvh) * d :].reshape(t, kvh, d).contiguous())
    return rot[:, :h].contiguous()


# --- decode attention from the paged pool --------------------------------------------------------------------
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D] fp32 (one token per request), caches [slots, KVH, D] fp32, request b attending to the slots
    req_to_token[rows[b], :seq_lens[b]] (int32 table, int64 rows and lengths); returns [B, H * D] fp32."""
    b, h, d = q.shape
    if q.stride(-1) != 1 or q.stride(1) != d:
        q = q.contiguous()
    _check(k_cache, v_cache, req_to_token, rows, seq_lens)
    out = torch.empty(b, h * d, dtype=torch.float32)
    load().decode_attention(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        rows.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        b,
        h,
        k_cache.shape[1],
        d,
        scale,
        max_len,
    )
    return out


def decode_attention_ref(q, k_cache, v_cache, req_to_token, rows, seq_lens, max_len, scale):
    outs = []
    for i in range(q.shape[0]):
        slots = req_to_token[rows[i], : seq_lens[i]].long()
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)  # [KVH, L, D]
        outs.append(F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True))
    return torch.stack(outs).reshape(q.shape[0], -1)


# --- silu(gate) * up -----------------------------------------------------------------------------------------
def silu_mul_bf16(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] bf16 -> silu(gate) * up [T, I] bf16, computed in fp32 and rounded once."""
    _check(gu)
    t, i = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(t, i, dtype=torch.bfloat16)
    load().silu_mul_bf16(gu.data_ptr(), out.data_ptr(), t, i)
    return out


def silu_mul_bf16_ref(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, -1)
    return (F.silu(g) * u).to(torch.bfloat16)


# --- x @ W.T on Q4_0 / Q4_1 blocks (AVX-512 BF16 or AVX2) -------------------------------------------------------
def q4_available() -> bool:
    """Whether this CPU and compiler gave the library its Q4 kernel (AVX-512 BF16 dot products, or AVX2 with
    FMA and F16C)."""
    lib = load()
    return lib is not None and bool(lib.q4_gemm_available())


def q4_isa() -> str | None:
    """Which Q4 kernel the library holds: "AVX-512 BF16", "AVX2", or None."""
    lib = load()
    return None if lib is None else {2: "AVX-512 BF16", 1: "AVX2"}.get(lib.q4_gemm_isa())


def q4_pack(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Nibbles q [N, K] (uint8, 0..15) and per-32 scales d, m [N, K/32] into the kernel's layout: output rows
    in tiles of 16 (the vector lanes), k in pairs (one bf16 dot product step). d and m go to fp16, which holds
    GGUF's fp16 values (and Q4_0's m = -8 d) exactly."""
    n, k = q.shape
    if n % 16 or k % 32:
        raise ValueError(f"the Q4 kernel needs N % 16 == 0 and K % 32 == 0, got {n}x{k}")
    t = q.reshape(n // 16, 16, k // 32, 16, 2).transpose(0, 2, 3, 1, 4)  # tile, block, pair, lane, k in pair
    qs = np.ascontiguousarray(t[..., 0] | (t[..., 1] << 4))
    dm = np.stack([a.reshape(n // 16, 16, k // 32).transpose(0, 2, 1) for a in (d, m)], axis=2)
    return torch.from_numpy(qs), torch.from_numpy(np.ascontiguousarray(dm.astype(np.float16)))


_scratch = threading.local()  # per thread: the bf16 copy of x and its block sums, reused across calls


def _q4_scratch(floats: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _scratch.buf = torch.empty(max(floats, 1 << 16), dtype=torch.float32)
    return buf


def q4_gemm(qs: torch.Tensor, dm: torch.Tensor, x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """x [M, K] fp32 @ W.T -> [M, N] fp32 for W packed by q4_pack (x is rounded to bf16 inside)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    words = rows * k  # the AVX2 path's fp32 copy of x; the AVX-512 one's bf16 pairs take half of it
    buf = _q4_scratch(words + rows * (k // 32))
    y = torch.empty(rows, n, dtype=torch.float32)
    ptr = buf.data_ptr()
    load().q4_gemm(
        qs.data_ptr(), dm.data_ptr(), x.data_ptr(), x.stride(0), ptr, ptr + 4 * words, y.data_ptr(), rows, n, k
    )
    return y


def q4_gemm_ref(q: np.ndarray, d: np.ndarray, m: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """The same product in fp64 over the dequantized weight, x rounded to bf16 as the kernel takes it."""
    n, k = q.shape
    w = q.reshape(n, k // 32, 32).astype(np.float64) * d.astype(np.float16)[..., None] + m.astype(np.float16)[..., None]
    return x.bfloat16().double() @ torch.from_numpy(w.reshape(n, k)).T
