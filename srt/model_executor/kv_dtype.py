"""The KV cache's element type (`--kv-cache-dtype`) and, for an e4m3 pool, its per-layer K and V scales.

An e4m3 element spans 2^-9 .. 448 with 3 mantissa bits, so each layer's K and V are stored divided by a scale
that brings their largest magnitude inside that range. The scales must be fixed before the first token is
stored (every cached token depends on them), and peers' defaults of 1.0 leave large keys saturated and small
values in subnormals. Here they are measured: one forward of a fixed, seeded token sequence at start-up into a
small pool of the model's dtype gives each layer's largest |K| and |V|; the scale keeps CALIBRATION_HEADROOM of
room above it, and values past e4m3's range saturate instead of overflowing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixlm.srt.mem_cache.memory_pool import TokenToKVPool
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode

if TYPE_CHECKING:
    from radixlm.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CALIBRATION_TOKENS = 512
CALIBRATION_HEADROOM = 2.0  # scale = headroom * amax / 448: a key twice the calibration's largest still fits
FP8_BACKENDS = ("triton", "torch_native")


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device, backend: str) -> torch.dtype:
    """The pool's dtype for --kv-cache-dtype `name`; a ValueError naming the cause where it cannot run."""
    if name == "auto":
        return model_dtype
    if name == "bf16":
        if model_dtype != torch.bfloat16:
            raise ValueError(f"kv_cache_dtype bf16 needs --dtype bfloat16 (the model runs in {model_dtype})")
        return torch.bfloat16
    if name != "fp8_e4m3":
        raise ValueError(f"kv_cache_dtype must be auto, bf16 or fp8_e4m3, got {name!r}")
    if backend not in FP8_BACKENDS:
        raise ValueError(
            f"kv_cache_dtype fp8_e4m3 runs on the {' or '.join(FP8_BACKENDS)} attention backends, not {backend}: "
            "use --attention-backend triton"
        )
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"kv_cache_dtype fp8_e4m3 needs e4m3 support (compute capability 8.9+); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}"
        )
    return FP8


def calibrate_kv_scales(runner: ModelRunner, tokens: int = CALIBRATION_TOKENS) -> None:
    """Set the runner's e4m3 pool's per-layer scales from one forward of `tokens` seeded random token ids
    (request row 0, which no request holds yet, is borrowed and cleared again)."""
    pool = runner.token_to_kv_pool
    n = max(1, min(tokens, runner.context_length, runner.req_to_token_pool.max_context_len - 1))
    cfg = runner.config
    probe = TokenToKVPool(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.dtype, runner.device)
    ids = torch.randint(0, runner.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    slots = torch.arange(1, n + 1, dtype=torch.int64)
    r2t = runner.req_to_token_pool
    r2t.write(0, 0, slots)
    spec = BatchSpec(
        ForwardMode.EXTEND,
        ids,
        list(range(n)),
        [0],
        [n],
        slots,
        logits_indices=[n - 1],
        extend_prefix_lens=[0],
        extend_seq_lens=[n],
    )
    runner.token_to_kv_pool = probe
    try:
        runner.forward(runner.build(spec))
    finally:
        runner.token_to_kv_pool = pool
        r2t.write(0, 0, torch.zeros(n, dtype=torch.int64))
    k_amax = probe.k_buffer[:, 1:].abs().amax(dim=(1, 2, 3)).float().cpu()
    v_amax = probe.v_buffer[:, 1:].abs().amax(dim=(1, 2, 3)).float().cpu()
    if not (torch.isfinite(k_amax).all() and torch.isfinite(v_amax).all()):
        raise ValueError("kv_cache_dtype fp8_e4m3: the calibration forward gave non-finite keys or values")
    pool.k_scale = [max(float(a) * CALIBRATION_HEADROOM / FP8_MAX, 1e-8) for a in k_amax]
    pool.v_scale = [max(float(a) * CALIBRATION_HEADROOM / FP8_MAX, 1e-8) for a in v_amax]
    logger.info(
        "fp8 KV cache: per-layer scales from a %d-token calibration forward: K %.3g..%.3g, V %.3g..%.3g",
        n,
        min(pool.k_scale),
        max(pool.k_scale),
        min(pool.v_scale),
        max(pool.v_scale),
    )
