"""Skinny matmuls for small decode batches: y = x @ W.T (+ bias) with x [M <= 8, K], W [N, K] row-major.

At batch 1 a decode step is weight streaming: every layer's GEMMs read 0.44 GB of an 8B model's weights for a
few FLOPs per byte, and cuBLAS picks tensor-core tiles sized for M >= 16 that leave the small projections
short of the HBM peak. These kernels give each program a band of weight rows and stream it once along K,
accumulating in fp32 on the CUDA cores. `gemv_silu_mul` also fuses the MLP activation into the gate_up
projection: each program reads a band of gate rows and the matching up rows, and writes silu(gate) * up.
Whether they beat cuBLAS depends on the shape and the GPU, so `GemvTuner` times both per (N, K, M) at start-up
and the ops use the kernel only where it measured faster.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from radixlm.kernels._triton import compile_ahead, gdc_launch_dependents, gdc_wait, launch, pdl_args, tl, triton
from radixlm.kernels.fp8_mm import CONFIGS as MMA_CONFIGS
from radixlm.kernels.fp8_mm import bucket as mma_bucket
from radixlm.kernels.fp8_mm import counters_at_rest, fp8_mm

logger = logging.getLogger(__name__)

MAX_M = 8


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, bias)


def gemv_silu_mul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = F.linear(x, w, bias).chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _load_w(rows, k0, K, rk, n_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(rows + k0, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
    return tl.load(rows + k0, mask=n_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_x(rows, k0, K, rk, m_mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(rows + k0, mask=m_mask[:, None], other=0.0).to(tl.float32)
    return tl.load(rows + k0, mask=m_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    up_offset,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    u_rows = w_rows + up_offset * stride_wn  # SILU_MUL: the up rows sit `up_offset` rows below the gate rows
    x_rows = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    # The first weight tile does not depend on the kernel before this one: load it before waiting for that
    # kernel's output (x), so under programmatic dependent launch the weight stream starts during its tail.
    w = _load_w(w_rows, 0, K, rk, n_mask, EVEN_K)
    if SILU_MUL:
        u = _load_w(u_rows, 0, K, rk, n_mask, EVEN_K)
    if USE_PDL:
        gdc_wait()
    # fp32 partial sums over K stay per lane ([M, N, K] products) and are reduced once at the end, so the loop
    # body is only loads and FMAs.
    x = _load_x(x_rows, 0, K, rk, m_mask, EVEN_K)
    acc = x[:, None, :] * w.to(tl.float32)[None, :, :]
    if SILU_MUL:
        acc_up = x[:, None, :] * u.to(tl.float32)[None, :, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _load_x(x_rows, k0, K, rk, m_mask, EVEN_K)
        acc += x[:, None, :] * _load_w(w_rows, k0, K, rk, n_mask, EVEN_K).to(tl.float32)[None, :, :]
        if SILU_MUL:
            acc_up += x[:, None, :] * _load_w(u_rows, k0, K, rk, n_mask, EVEN_K).to(tl.float32)[None, :, :]
    if USE_PDL:
        # The next kernel may launch once every program of this one is past its weight stream: a GEMV after a
        # GEMV (down after gate_up) then loads its first tile during this one's tail, not while this one's
        # later waves still need the SM slots its waiting programs would hold.
        gdc_launch_dependents()
    y = tl.sum(acc, axis=2)
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        up = tl.sum(acc_up, axis=2)
        if HAS_BIAS:
            up += tl.load(b_ptr + up_offset + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        # Round as the unfused path does: projection to the activation dtype, silu to it, then the product.
        gate = y.to(out_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
        y = act * up.to(out_ty).to(tl.float32)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ty), mask=m_mask[:, None] & n_mask[None, :])


# (BLOCK_N, BLOCK_K, num_warps) candidates; the tuner times them per shape. Register use grows with
# BLOCK_M * BLOCK_N * BLOCK_K, so larger batches get the narrower tiles.
CONFIGS: dict[int, list[tuple[int, int, int]]] = {
    1: [
        (8, 256, 4),
        (4, 512, 4),
        (2, 1024, 4),
        (4, 1024, 8),
        (8, 512, 8),
        (16, 512, 8),
        (1, 1024, 4),
        (1, 2048, 4),
        (2, 2048, 8),
    ],
    2: [(8, 256, 4), (8, 128, 4), (4, 256, 4)],
    4: [(8, 128, 4), (4, 256, 4), (4, 128, 4)],
    8: [(4, 128, 4), (8, 64, 4), (2, 256, 4)],
}


def _block_m(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8


def _launch(x, w, bias, silu_mul: bool, config: tuple[int, int, int]) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0] // 2 if silu_mul else w.shape[0]
    if silu_mul:
        # Halving the tile keeps the two accumulators at one plain tile's registers.
        config = (max(1, config[0] // 2), config[1], config[2])
    block_n, block_k, warps = config
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    launch(
        _gemv_kernel,
        (triton.cdiv(n, block_n),),
        x,
        w,
        bias if bias is not None else w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        n,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul,
        EVEN_K=k % block_k == 0,
        BLOCK_M=_block_m(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        **pdl_args(x.device),
    )
    return out


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 8), w [N, K] contiguous rows -> [M, N]."""
    assert x.shape[0] <= MAX_M and w.stride(1) == 1
    return _launch(x, w, bias, False, config or CONFIGS[_block_m(x.shape[0])][0])


def gemv_silu_mul(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 8), w [2N, K] (gate rows, then up rows) -> silu(x @ gate.T) * (x @ up.T), [M, N]."""
    assert x.shape[0] <= MAX_M and w.stride(1) == 1 and w.shape[0] % 2 == 0
    return _launch(x, w, bias, True, config or CONFIGS[_block_m(x.shape[0])][0])


def scaled_mm_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The large-batch FP8 path (W8A8: x quantized per token, cuBLASLt's row-wise scaled GEMM), `x`'s dtype out."""
    from radixlm.kernels.fp8_quant import quantize_tokens  # noqa: PLC0415

    xq, xs = quantize_tokens(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.reshape(1, -1), out_dtype=x.dtype)


# Decisions already timed in this process, per GPU model: every engine the process starts makes the same picks,
# so its numerics do not depend on which kernel won a close race at its own start-up (the kernels round
# differently: W8A16 against W8A8, or another accumulation order).
_DECIDED: dict[tuple[str, tuple], tuple[str, tuple] | None] = {}


class GemvTuner:
    """Per (N, K, fused, M bucket, FP8 weight): the fastest of the library path (None: cuBLAS; for FP8 weights
    the scaled GEMM) and our kernels: this module's GEMV configs for bf16/fp16 weights up to batch 8, the
    tensor-core kernel's configs (`fp8_mm.py`) for FP8 weights up to batch 256; timed on this GPU once per
    process. A pick is ("gemv" | "mma", config). Every FP8 candidate computes W8A8 (x quantized per token): a
    W8A16 GEMV was as fast at batch 1, but a request's numerics would then change with the batch it runs in."""

    def __init__(self):
        self.choice: dict[tuple[int, int, bool, int, bool], tuple[str, tuple] | None] = {}
        self.report: list[str] = []

    @staticmethod
    def bucket(m: int, fp8: bool) -> int | None:
        if m == 0 or m > (256 if fp8 else MAX_M):
            return None
        return _block_m(m) if m <= MAX_M else mma_bucket(m)

    def lookup(self, m: int, w: torch.Tensor, silu_mul: bool) -> tuple[str, tuple] | None:
        fp8 = w.element_size() == 1
        b = self.bucket(m, fp8)
        return None if b is None else self.choice.get((w.shape[0], w.shape[1], silu_mul, b, fp8))

    def tune(self, weights: list[tuple[torch.Tensor, bool, torch.Tensor | None]]) -> list[str]:
        """weights: one (weight, fused with silu_mul, per-row scale of an FP8 weight or None) per distinct shape.
        Returns a line per decision."""
        lines = []
        ahead = compile_ahead(self._launches(weights))
        if ahead is not None and ahead[0]:
            lines.append(f"compiled {ahead[0]} candidate launches ahead in {ahead[1]:.1f} s")
        for w, fused, scale in weights:
            fp8 = scale is not None
            pending = self._pending(w, fused, fp8)
            if not pending:
                continue
            # Distinct copies of the weight, together 4x the L2 cache, so that each timed call streams its
            # weights from HBM as it does inside a real step (where the other layers evicted them).
            l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
            copies = [w] + [w.clone() for _ in range(min(7, -(-4 * l2 // (w.numel() * w.element_size())) - 1))]
            dtype = torch.bfloat16 if fp8 else w.dtype
            # Correctness is checked on a band of rows (the same kernel and K; an exact copy of a whole LM head
            # would not fit beside a model that fills the GPU)
            cw, cs = _check_rows(w, scale, fused)

            def library(x, c, s=scale):
                if not fp8:
                    return (gemv_silu_mul_ref if fused else gemv_ref)(x, c)
                return _silu_mul(scaled_mm_ref(x, c, s)) if fused else scaled_mm_ref(x, c, s)

            for bm in pending:
                key = (w.shape[0], w.shape[1], fused, bm, fp8)
                x = torch.randn(bm, w.shape[1], dtype=dtype, device=w.device)
                base = _time_calls([lambda c=c: library(x, c) for c in copies])
                best, best_t = None, base
                expect = library(x, cw, cs)  # the same arithmetic: a wrong config is far off
                ours, failed, wrong = (None, float("inf")), 0, []
                for kind, cfg in _tries(bm, fp8):
                    # A split-K config must leave its tile counters at 0 (counters_at_rest also clears them, so
                    # that one config's fault is not blamed on the next)
                    at_rest = lambda: kind != "mma" or counters_at_rest(w.device)  # noqa: E731
                    try:
                        err = _rel_err(_candidate(kind, x, cw, cs, cfg, fused), expect)
                    except Exception as e:  # noqa: BLE001 - a config this GPU or compiler cannot build
                        logger.debug("skinny matmul %s %s failed: %s", kind, cfg, e)
                        failed += 1
                        at_rest()
                        continue
                    rest = at_rest()
                    if not rest or not err <= 2e-2:  # never a wrong one (nor one whose error is not a number)
                        wrong.append(f"{cfg} err {err:.2g}" + ("" if rest else ", counters left set"))
                        continue
                    t = _time_calls([lambda c=c, k=kind, g=cfg: _candidate(k, x, c, scale, g, fused) for c in copies])
                    if not at_rest():  # replayed back to back, it left a counter set
                        wrong.append(f"{cfg} counters left set")
                        continue
                    ours = min(ours, ((kind, cfg), t), key=lambda p: p[1])
                    if t < best_t:
                        best, best_t = (kind, cfg), t
                self.choice[key] = _DECIDED[(torch.cuda.get_device_name(w.device), key)] = best
                lib = "scaled GEMM" if fp8 else "cuBLAS"
                # what lost says as much as what won: the fastest of ours, and any that could not run or were wrong
                lost = f"; ours at best {ours[0][1]} {ours[1] * 1e3:.1f} us" if best is None and ours[0] else ""
                lost += f"; {failed} not built" if failed else ""
                lost += f"; wrong: {', '.join(wrong)}" if wrong else ""
                lines.append(
                    f"N={w.shape[0]} K={w.shape[1]} {'fp8 ' if fp8 else ''}{'gate_up+silu ' if fused else ''}"
                    f"M<={bm}: {lib} {base * 1e3:.1f} us, best {lib if best is None else best} {best_t * 1e3:.1f} us"
                    + lost
                )
            del copies
        self.report += lines
        return lines

    def _pending(self, w: torch.Tensor, fused: bool, fp8: bool) -> list[int]:
        """The batch buckets of this weight still to time: picks this process made already on this GPU model are
        taken as they are (see _DECIDED)."""
        gpu, pending = torch.cuda.get_device_name(w.device), []
        for bm in (*CONFIGS, *(MMA_CONFIGS if fp8 else ())):
            key = (w.shape[0], w.shape[1], fused, bm, fp8)
            if key not in self.choice and (gpu, key) in _DECIDED:
                self.choice[key] = _DECIDED[(gpu, key)]
            if key not in self.choice:
                pending.append(bm)
        return pending

    def _launches(self, weights: list[tuple[torch.Tensor, bool, torch.Tensor | None]]):
        """Each candidate launch `tune` will make (a zero-argument call), for `compile_ahead`: the same kernels,
        configs and batch rows, on the whole weight (the timed calls) and on its band of rows (the correctness
        call: a row count that divides by 16 where the weight's may not is another specialization); a launch
        that both make compiles once."""
        for w, fused, scale in weights:
            fp8 = scale is not None
            pending = self._pending(w, fused, fp8)
            if not pending:
                continue
            band = _check_rows(w, scale, fused)
            for bm in pending:
                x = torch.randn(bm, w.shape[1], dtype=torch.bfloat16 if fp8 else w.dtype, device=w.device)
                for c, s in {id(w): (w, scale), id(band[0]): band}.values():
                    for kind, cfg in _tries(bm, fp8):
                        yield lambda x=x, kind=kind, cfg=cfg, c=c, s=s, f=fused: _candidate(kind, x, c, s, cfg, f)


def _tries(bm: int, fp8: bool) -> list[tuple[str, tuple]]:
    """The candidates for a batch of `bm` rows: the tensor-core kernel's configs of its bucket for FP8 weights,
    this module's GEMV configs otherwise."""
    if fp8:
        return [("mma", cfg) for cfg in MMA_CONFIGS[mma_bucket(bm)]]
    return [("gemv", cfg) for cfg in CONFIGS.get(bm, ())]


def _candidate(kind: str, x: torch.Tensor, w: torch.Tensor, scale, cfg: tuple, fused: bool) -> torch.Tensor:
    return fp8_mm(x, w, scale, None, cfg, fused) if kind == "mma" else _launch(x, w, None, fused, cfg)


def _check_rows(w: torch.Tensor, scale: torch.Tensor | None, fused: bool, rows: int = 4096):
    """At most `rows` output rows of a weight (and their scales) for a correctness check; for a fused gate_up,
    the same band of gate rows and of up rows."""
    n = w.shape[0] // 2 if fused else w.shape[0]
    if n <= rows:
        return w, scale
    idx = torch.arange(rows, device=w.device)
    idx = torch.cat([idx, idx + n]) if fused else idx
    return w[idx].contiguous(), None if scale is None else scale.reshape(-1)[idx].contiguous()


def _silu_mul(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _time_calls(calls, rounds: int = 4, graph_reps: int = 5) -> float:
    """Milliseconds per call, with the calls captured back to back in one CUDA graph (as a decode step runs
    them) so that Python's launch cost is not timed; median over replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(rounds):
            for fn in calls:
                fn()
    graph.replay()
    times = []
    for _ in range(graph_reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    times.sort()
    return times[len(times) // 2]
