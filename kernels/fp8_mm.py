"""FP8 matmuls on the tensor cores for decode-sized batches: y = (x quantized per token) @ W.T with W [N, K] in
e4m3 and one float32 scale per row (W8A8, the scaled GEMM's arithmetic).

The CUDA-core GEMV (`gemv.py`) converts every e4m3 weight to fp32 before its FMA: at one byte per weight the
conversion, not HBM, bounds it. Here the weight tile goes to the tensor cores as it is, with the weights as the
MMA's tall operand ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M], the batch padded to 16 rows), so the loop is loads
and MMAs. x is quantized per token by `fp8_quant.quantize_tokens` first: quantizing it inside this kernel (an
amax pass per program, then tiles converted on the fly) measured slower on an H100 at every shape, as the
converted tiles go through shared memory on every step. `silu_mul` fuses the MLP activation into the gate_up
projection as the GEMV does. Each tile's MMA sum is added to a float32 accumulator (`_mma`), as the scaled GEMM
does; the tiles come through pointer loads or, in some configs, TMA descriptors.
"""

from __future__ import annotations

import torch

from radixlm.kernels._triton import gdc_launch_dependents, gdc_wait, launch, pdl_args, tl, triton


@triton.jit
def _load_tile(ptrs, k0, K, rk, row_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs + k0, mask=row_mask[:, None], other=0.0)
    return tl.load(ptrs + k0, mask=row_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0)


@triton.jit
def _epilogue(acc, acc_up, xs, rn, rm, n_mask, m_mask, ws_ptr, b_ptr, out_ptr, stride_om, up_offset,
              HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):  # fmt: skip
    out_ty = out_ptr.dtype.element_ty
    y = acc * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)[:, None] * xs[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        up = acc_up * tl.load(ws_ptr + up_offset + rn, mask=n_mask, other=0.0)[:, None] * xs[None, :]
        if HAS_BIAS:
            up += tl.load(b_ptr + up_offset + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        # Round as the unfused path does: projection to the activation dtype, silu to it, then the product.
        gate = y.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        y = act * up.to(out_ty).to(tl.float32)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _mma(w, xt, acc, PRECISE: tl.constexpr):
    """acc + w @ xt. Hopper's FP8 MMA keeps its running sum in a truncating accumulator (Triton lets it run over
    the whole K by default on sm_90): over K = 8,192 that measured up to 9% off the scaled GEMM's result on a 70B
    projection. PRECISE: each tile's products are summed by the MMA from zero and added to `acc` in float32 (the
    promotion cuBLAS and CUTLASS do), so the truncation spans one tile's K, not the row's."""
    if PRECISE:
        return acc + tl.dot(w, xt)
    return tl.dot(w, xt, acc)


@triton.jit
def _finish(acc, acc_up, pid_n, pid_m, pid_k, rn, rm, n_mask, m_mask, xs_ptr, ws_ptr, b_ptr, out_ptr, part_ptr,
            count_ptr, stride_om, up_offset, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
            SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    xs = tl.load(xs_ptr + rm, mask=m_mask, other=1.0)
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, xs, rn, rm, n_mask, m_mask, ws_ptr, b_ptr, out_ptr, stride_om, up_offset,
                  HAS_BIAS, SILU_MUL)  # fmt: skip
    else:
        # Split K: each program leaves its partial sums in the workspace; the last of a tile's SPLIT_K programs
        # to arrive (a counter per tile) adds them up, runs the epilogue and resets the counter for the next launch.
        tile = pid_m * tl.num_programs(0) + pid_n
        cell = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        parts = part_ptr + tile.to(tl.int64) * (SPLIT_K * 2 * BLOCK_N * BLOCK_M)
        tl.store(parts + pid_k * BLOCK_N * BLOCK_M + cell, acc)
        if SILU_MUL:
            tl.store(parts + (SPLIT_K + pid_k) * BLOCK_N * BLOCK_M + cell, acc_up)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(parts + s * BLOCK_N * BLOCK_M + cell, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(parts + (SPLIT_K + s) * BLOCK_N * BLOCK_M + cell, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)
            _epilogue(acc, acc_up, xs, rn, rm, n_mask, m_mask, ws_ptr, b_ptr, out_ptr, stride_om, up_offset,
                      HAS_BIAS, SILU_MUL)  # fmt: skip


@triton.jit
def _tile(src, ptrs, row0, k0, K, rk, row_mask, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """The [rows, BLOCK_K] tile at column k0: from the TMA descriptor `src` at row `row0`, or through `ptrs` (the
    tile's row pointers at column 0) masked to `row_mask` and K."""
    # An else, not an early return: the compiler still builds what follows a return under a constexpr if, and a
    # descriptor cannot be added to as `_load_tile` does with pointers.
    if TMA:
        tile = src.load([row0, k0])
    else:
        tile = _load_tile(ptrs, k0, K, rk, row_mask, EVEN_K)
    return tile


@triton.jit
def _fp8_mm_kernel(
    x_src,
    xs_ptr,
    w_src,
    ws_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    up_offset,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA: tl.constexpr,
    USE_PDL: tl.constexpr,
    PRECISE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """x_src and w_src: the matrices' pointers, or (TMA) their tensor descriptors, through which the copy engine
    fetches the tiles: no address arithmetic or masks in the loop (the hardware fills rows and columns past the
    matrix with zeros), and the tiles land in shared memory without passing through registers."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0 = pid_n * BLOCK_N
    m0 = pid_m * BLOCK_M
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = m0 + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if TMA:  # descriptors take row offsets: no pointer tiles
        w_rows = w_src
        u_rows = w_src
        x_rows = x_src
    else:
        w_rows = w_src + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        u_rows = w_rows + up_offset * stride_wn  # SILU_MUL: the up rows sit `up_offset` rows below the gate rows
        x_rows = x_src + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    # The weights do not depend on the kernel before this one: start their stream before waiting for it (PDL).
    # The first K step is peeled so that the loop's loads are unconditional, which Triton's pipeliner needs.
    w = _tile(w_src, w_rows, n0, k_lo, K, rk, n_mask, EVEN_K, TMA)
    if SILU_MUL:
        u = _tile(w_src, u_rows, n0 + up_offset, k_lo, K, rk, n_mask, EVEN_K, TMA)
    if USE_PDL:
        gdc_wait()
    xt = tl.trans(_tile(x_src, x_rows, m0, k_lo, K, rk, m_mask, EVEN_K, TMA))
    acc = tl.dot(w, xt)
    acc_up = tl.dot(u, xt) if SILU_MUL else acc
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        xt = tl.trans(_tile(x_src, x_rows, m0, k0, K, rk, m_mask, EVEN_K, TMA))
        acc = _mma(_tile(w_src, w_rows, n0, k0, K, rk, n_mask, EVEN_K, TMA), xt, acc, PRECISE)
        if SILU_MUL:
            acc_up = _mma(_tile(w_src, u_rows, n0 + up_offset, k0, K, rk, n_mask, EVEN_K, TMA), xt, acc_up, PRECISE)
    if USE_PDL:
        # The next kernel may launch once every program is past its K loop. Firing right after gdc_wait instead
        # (its programs resident and waiting sooner) was measured on the 70B step: no gain at batch 1, 0.7%
        # slower at batch 8 (benchmarks/results/README.md, "early launch of the next kernel").
        gdc_launch_dependents()
    _finish(acc, acc_up, pid_n, pid_m, pid_k, rn, rm, n_mask, m_mask, xs_ptr, ws_ptr, b_ptr, out_ptr, part_ptr,
            count_ptr, stride_om, up_offset, HAS_BIAS, SILU_MUL, SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip


# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) candidates per batch bucket; the tuner times them per shape
# against the scaled GEMM and the GEMV. BLOCK_N 64 per warpgroup is Hopper's MMA height; splitting K fills the
# SMs where N / BLOCK_N programs alone would not (N = 4096 is 64 programs on a 132-SM H100).
_ONE = [(64, 256, 4, 4), (64, 128, 4, 6), (64, 512, 4, 3), (128, 256, 8, 3)]
_SPLIT = [(64, 256, 4, 4, 2), (64, 256, 4, 4, 4), (64, 512, 4, 3, 2), (64, 128, 4, 6, 2), (64, 256, 4, 4, 3)]
# At 64-128 rows a 70B shard's projections with N / 64 programs or fewer (qkv, o, down at tp 2 and more) reached
# 30-60% of HBM bandwidth on an H200 with these alone: more programs in flight by splitting K.
_SPLIT_64 = [(64, 256, 4, 4, 3), (64, 256, 4, 4, 4), (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (64, 512, 4, 3, 2)]
# At 64 rows a 64-row weight tile is as large as the x tile every program also reads: 128-row tiles halve the x
# traffic (the 70B qkv, split 4 over 64-row tiles, ran at 45% of HBM bandwidth in a 64-request step on an H200).
_SPLIT_64 += [(128, 128, 8, 4, 2), (128, 128, 8, 4, 4)]
_SPLIT_128 = [(64, 128, 4, 4, 2), (64, 256, 4, 4, 2), (128, 128, 8, 4, 2), (64, 256, 4, 4, 4)]
POINTER_LOADS, TMA_LOADS = 0, 1  # how a config's tiles reach shared memory (the 6th field)
# The same tiles fetched by TMA, where they measured faster than pointer loads on an H200 (by 1-3%: o and down at
# 64 rows, gate_up at 1-32; bench_fp8_mm.py). A warp-specialized loop (Triton 3.6's `warp_specialize`) was never
# faster there, and its split-K programs left tile counters set (a wrong sum in every later split on those tiles).
_TMA_CANDIDATES = [(*c, TMA_LOADS) for c in [(64, 256, 4, 4, 1), (128, 128, 8, 4, 1), (64, 256, 4, 4, 2),
                                              (128, 256, 8, 3, 2)]]  # fmt: skip
# Past 64 rows a program of 64 batch rows leaves the weights to be read once per 64 rows (from L2 at best): at 128
# rows on an H200 the best such config took 1.5x the scaled GEMM on the 70B gate_up. These take the whole bucket
# in one program column (BLOCK_M 128 or 256: the MMA's N; accumulators of BLOCK_N x BLOCK_M floats), so each
# weight tile is read once, for batches of 65-256 rows (the serving decode at 128-256 users).
_WHOLE = {  # at most 128 accumulator floats a thread (twice for gate_up + SiLU's two, at half the tile height)
    128: [(64, 128, 4, 3, 1, POINTER_LOADS, 128), (128, 128, 8, 3, 1, POINTER_LOADS, 128),
          (64, 256, 4, 2, 1, POINTER_LOADS, 128), (128, 128, 8, 3, 1, TMA_LOADS, 128),
          (64, 128, 4, 3, 2, POINTER_LOADS, 128)],
    256: [(64, 128, 8, 3, 1, POINTER_LOADS, 256), (128, 128, 8, 3, 1, POINTER_LOADS, 256),
          (64, 256, 8, 2, 1, POINTER_LOADS, 256), (128, 128, 8, 3, 1, TMA_LOADS, 256),
          (128, 64, 8, 4, 1, POINTER_LOADS, 256)],
}  # fmt: skip
CONFIGS: dict[int, list[tuple[int, ...]]] = {
    16: [(*c, 1) for c in _ONE] + _SPLIT + _TMA_CANDIDATES,
    32: [(*c, 1) for c in _ONE] + _SPLIT[:3] + _TMA_CANDIDATES,
    64: [(64, 128, 4, 4, 1), (128, 128, 8, 4, 1), (128, 256, 8, 3, 1), (64, 256, 4, 3, 1), (64, 256, 4, 4, 2)]
    + _SPLIT_64
    + _TMA_CANDIDATES,
    128: [(128, 128, 8, 4, 1), (64, 128, 4, 4, 1), (128, 256, 8, 3, 1), (256, 128, 8, 3, 1), (128, 256, 8, 3, 2)]
    + _SPLIT_128
    + _TMA_CANDIDATES
    + _WHOLE[128],
    256: _WHOLE[256],
}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 16


def counters_at_rest(device: torch.device) -> bool:
    """Whether every split-K tile counter on `device` is back at 0, as each launch's last program leaves its
    tiles'. One left set would make the next split launch on that tile sum the wrong partials: a tuner drops the
    config that did it, and this zeroes them again."""
    counters = _COUNTERS.get(device)
    if counters is None or not bool(counters.any()):
        return True
    counters.zero_()
    return False


def bucket(m: int) -> int:
    """The batch bucket a batch of m rows runs in (its configs; BLOCK_M unless a config says otherwise)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256


def fp8_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    silu_mul: bool = False,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    precise: bool = True,
) -> torch.Tensor:
    """x [M, K] in bf16/fp16 (quantized per token here first; or, with `x_scale` [M] / [M, 1], already e4m3),
    w [N, K] e4m3 with `scale` [N] float32 -> [M, N] in `out_dtype` (default: x's dtype, bf16 for e4m3 x).
    `silu_mul`: w holds gate rows then up rows and the result is silu(gate) * up, [M, N / 2].
    `config`: (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K[, LOADS[, BLOCK_M]]) with LOADS POINTER_LOADS
    (the default) or TMA_LOADS, and BLOCK_M the batch rows per program (default: the bucket's, at most 64).
    `precise=False` (benchmarks only: what the float32 promotion costs) leaves the MMA's truncating accumulator
    running over all of K (see `_mma`)."""
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    block_n, block_k, warps, stages, split, *rest = config or CONFIGS[bucket(m)][0]
    loads = rest[0] if rest else POINTER_LOADS
    block_m = rest[1] if len(rest) > 1 else min(bucket(m), 64)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if x_scale is not None else x.dtype
    if x_scale is None:
        from radixlm.kernels.fp8_quant import quantize_tokens  # noqa: PLC0415

        x, x_scale = quantize_tokens(x)
    if silu_mul and block_n > 64:
        block_n //= 2  # two accumulators
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    counters = part = scale
    if split > 1:
        assert grid[0] * grid[1] <= _MAX_TILES
        counters = _COUNTERS.get(x.device)
        if counters is None:  # zeroed once; the last program of each tile sets its counter back to 0
            counters = _COUNTERS[x.device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=x.device)
        part = torch.empty(grid[0] * grid[1] * split * 2 * block_n * block_m, dtype=torch.float32, device=x.device)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    x_src, w_src, tma = x, w, loads != POINTER_LOADS and _tma_ok(x, w)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

        x_src = TensorDescriptor.from_tensor(x, [block_m, block_k])
        w_src = TensorDescriptor.from_tensor(w, [block_n, block_k])
    launch(
        _fp8_mm_kernel,
        grid,
        x_src,
        x_scale.reshape(-1),
        w_src,
        scale.reshape(-1),
        bias if bias is not None else scale,
        out,
        part,
        counters,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        n,
        k_per_split,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        EVEN_K=k % block_k == 0,
        TMA=tma,
        PRECISE=precise,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x.device),
    )
    return out


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine can address these matrices: rows contiguous, base and row stride on 16 bytes (a
    view that is not falls back to pointer loads with the same tiles)."""
    return all(
        t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors
    )
