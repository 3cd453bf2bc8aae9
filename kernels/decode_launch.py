"""How a decode-attention launch is shaped (decode_attention.py's kernels): splits per request, keys per tile,
pipeline stages by what the GPU's shared memory allows, and which float16 paths an e4m3 pool takes. Each default
is the tuner's finding (benchmarks/gpu/tune_decode_attention.py), written where it is decided."""

from __future__ import annotations

import functools
import math

import torch

from radixlm.kernels import INTERPRET
from radixlm.kernels._triton import triton

MAX_SPLITS = 16


def decode_num_splits(batch_size: int, num_kv_heads: int, num_sms: int, kv_dtype: torch.dtype | None = None) -> int:
    """Enough (request, KV head, split) programs for about two waves over the SMs, at most MAX_SPLITS. An e4m3
    pool's launch (five stages: two programs fit an SM) takes as many splits as one wave of two programs an SM
    holds, so unsplit from one full wave on (stage 1 then writes the output and no merge runs): at batch 32,
    34 against 46 us with two splits; at 16, 23 against 30 us with three (70B shape, context 1,500, H200;
    benchmarks/gpu/tune_decode_attention.py)."""
    items = max(1, batch_size * num_kv_heads)
    if kv_dtype == torch.float8_e4m3fn:
        return max(1, min(MAX_SPLITS, 2 * num_sms // items))
    return max(1, min(MAX_SPLITS, math.ceil(2 * num_sms / items)))


def shared_bytes(block_n: int, head_dim: int, num_stages: int, fp8: bool, v_staged: bool) -> int:
    """Shared memory one stage-1 program takes (as Triton lays it out for a 16-row query tile): the K and V tiles
    (one buffer each below five stages, two from five: the slot indices are loaded a stage ahead of the tiles they
    address), their slot indices, the query and the probabilities as float16 dot operands, and a float16 copy of
    V when it is widened first. Exact for the e4m3 launches compiled for sm_90 (74,240 and 107,520 bytes at 128
    keys, head 128, three and five stages)."""
    buffers = 2 if num_stages >= 5 else 1
    kv = buffers * 2 * block_n * head_dim * (1 if fp8 else 2)
    staged = block_n * head_dim * 2 if v_staged else 0
    return kv + buffers * block_n * 4 + 16 * head_dim * 2 + 16 * block_n * 2 + staged


def launch_defaults(
    kv_dtype: torch.dtype, num_splits: int, block_n: int | None, num_stages: int | None, head_dim: int = 128,
    max_shared: int | None = None,
):  # fmt: skip
    """Keys per tile and pipeline stages where the caller gives none (benchmarks/gpu/tune_decode_attention.py).
    A bf16 pool: many splits (small batches) leave each split a few hundred keys, and smaller tiles finish sooner
    (about 15% at batch 1, context 512). An e4m3 pool: tiles of 128 keys (as many bytes as 64 bf16 keys) and five
    stages: the slot indices are loaded a stage ahead of the K and V tiles they address, and only from five stages
    does Triton give K and V two shared-memory buffers, so that the next tile arrives while this one is used
    (batch 64-256 at context 1,500: 6-22% faster than three stages with V widened first). Where a program cannot
    have that much shared memory (`max_shared`, bytes; e.g. about 100 KB on sm_89), three stages."""
    fp8 = kv_dtype == torch.float8_e4m3fn
    if block_n is None:
        block_n = 128 if fp8 else 32 if num_splits >= 8 else 64
    if num_stages is None:
        num_stages = 2
        if fp8:
            deep = max_shared is None or shared_bytes(block_n, head_dim, 5, True, True) <= max_shared
            num_stages = 5 if deep else 3
    return block_n, num_stages


@functools.cache
def max_shared_bytes(device_index: int) -> int:
    """The most shared memory one program may use on that GPU (Triton's own limit when it launches)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def _max_shared(t: torch.Tensor) -> int | None:
    return max_shared_bytes(t.device.index or 0) if t.is_cuda and not INTERPRET else None


def default_f16_dot(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether the dots run in float16 by default: over an e4m3 pool, unless the query is float32."""
    return kv_dtype == torch.float8_e4m3fn and q_dtype != torch.float32


def default_v_staged(kv_dtype: torch.dtype, f16_dot: bool) -> bool:
    """Whether an e4m3 pool's V tiles are widened before the P x V dot's layout change (compiled code only)."""
    return f16_dot and kv_dtype == torch.float8_e4m3fn and not INTERPRET
