"""The small per-layer ops a forward is made of, as one swappable set: torch references (CPU, and the
fallback), our Triton kernels (CUDA), or FlashInfer's where they measure faster. The model runner picks the
set once and hands it to the model (`set_kernel_ops`); layers never branch on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels.activation import silu_and_mul_ref
from radixlm.kernels.norm import fused_add_rmsnorm_ref, rmsnorm_ref
from radixlm.kernels.rope import rope_and_store_ref


def cpu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b), the torch set's linear. On a CPU in float32 with 2..32 rows it is computed as (w @ x.T).T:
    MKL's sgemm for x @ w.T packs the weight first and so streams it from memory at a fraction of the rate that
    (w @ x.T) reads it (2-5x slower at 2-3 rows on every projection of the embedded model's shape, weights cold
    as in a forward; as fast or slower up to 32 rows; faster beyond). One row (MKL's GEMV) and bfloat16 keep
    F.linear, which is as fast or faster there."""
    if x.dtype == torch.float32 and x.dim() == 2 and 2 <= x.shape[0] <= 32 and x.device.type == "cpu":
        y = torch.mm(w, x.t()).t().contiguous()
        return y if b is None else y.add_(b)
    return F.linear(x, w, b)


@dataclass(frozen=True)
class KernelOps:
    name: str
    rmsnorm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> (rmsnorm(x + residual), x + residual); may reuse x and residual's memory.
    fused_add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # (positions, q, k, v, cos_sin, k_cache, v_cache, loc, q_norm_w, k_norm_w, eps) -> rotated q; stores k, v.
    rope_and_store: Callable[..., torch.Tensor]
    # (x, weight, bias) -> x @ weight.T + bias
    linear: Callable[..., torch.Tensor] = cpu_linear
    # (x, gate_up weight, bias) -> silu(gate) * up of the fused projection
    gate_up_silu: Callable[..., torch.Tensor] = lambda x, w, b: silu_and_mul_ref(cpu_linear(x, w, b))
    # (x, Fp8Linear) -> x @ W.T, and (x, Fp8Linear, rows) -> silu(gate) * up of an FP8 gate_up projection; with
    # `rows` (the down projection is FP8 too) it may come as Fp8Rows, quantized per token for that projection
    fp8_linear: Callable[..., torch.Tensor] = lambda x, q: q.matmul(x)
    fp8_gate_up_silu: Callable[..., torch.Tensor] = lambda x, q, rows=False: silu_and_mul_ref(q.matmul(x))
    # (x, residual | None, weight, eps) -> (Fp8Rows of rmsnorm(x [+ residual]), the residual stream): the norm
    # before an FP8 projection writing its rows in e4m3; None where the set has no such kernel.
    rmsnorm_fp8: Callable[..., tuple] | None = None
    # Times the skinny-matmul kernels against cuBLAS for the model's shapes (CUDA sets only).
    tuner: object | None = None


TORCH_OPS = KernelOps("torch", rmsnorm_ref, fused_add_rmsnorm_ref, silu_and_mul_ref, rope_and_store_ref)


def _skinny_linears(silu_and_mul: Callable, silu_and_mul_fp8: Callable):
    """linear and gate_up_silu that use our GEMV kernels for the (N, K, batch) where the tuner found them
    faster than cuBLAS, and cuBLAS (+ `silu_and_mul`) elsewhere."""
    from radixlm.kernels.fp8_mm import fp8_mm
    from radixlm.kernels.gemv import GemvTuner, gemv, gemv_silu_mul
    from radixlm.srt.layers.quantization.fp8 import Fp8Rows

    tuner = GemvTuner()

    def linear(x, w, b=None):
        pick = tuner.lookup(x.shape[0], w, False) if x.dim() == 2 else None
        return F.linear(x, w, b) if pick is None else gemv(x, w, b, pick[1])

    def gate_up_silu(x, w, b=None):
        pick = tuner.lookup(x.shape[0], w, True) if x.dim() == 2 else None
        return silu_and_mul(F.linear(x, w, b)) if pick is None else gemv_silu_mul(x, w, b, pick[1])

    # FP8 weights (W8A8): our tensor-core kernel where it measured faster than quantizing x and running the
    # scaled GEMM. x may come already quantized (Fp8Rows, from the norm before the projection).
    def fp8_mm_of(x, q, config, silu_mul=False):
        if isinstance(x, Fp8Rows):
            return fp8_mm(x.q, q.weight, q.scale, None, config, silu_mul, x_scale=x.scale, out_dtype=x.dtype)
        return fp8_mm(x, q.weight, q.scale, None, config, silu_mul)

    def fp8_linear(x, q):
        pick = tuner.lookup(x.shape[0], q.weight, False) if x.dim() == 2 else None
        return q.matmul(x) if pick is None else fp8_mm_of(x, q, pick[1])

    def fp8_gate_up_silu(x, q, rows=False):
        pick = tuner.lookup(x.shape[0], q.weight, True) if x.dim() == 2 else None
        if pick is not None:  # silu fused into our kernel's epilogue; the down projection quantizes its rows
            return fp8_mm_of(x, q, pick[1], silu_mul=True)
        y = q.matmul(x)  # the scaled GEMM (large batches): silu and the down projection's quantization in one
        return Fp8Rows(*silu_and_mul_fp8(y), y.dtype) if rows and y.dim() == 2 else silu_and_mul(y)

    return linear, gate_up_silu, fp8_linear, fp8_gate_up_silu, tuner


def fp8_rows_of(norm: Callable) -> Callable:
    """A norm that returns (e4m3 rows, scales, residual) as the op set's `rmsnorm_fp8` (Fp8Rows, residual)."""
    from radixlm.srt.layers.quantization.fp8 import Fp8Rows

    def rmsnorm_fp8(x, residual, weight, eps):
        q, scale, residual = norm(x, residual, weight, eps)
        return Fp8Rows(q, scale, x.dtype), residual

    return rmsnorm_fp8


def triton_ops() -> KernelOps:
    from radixlm.kernels.activation import silu_and_mul, silu_and_mul_fp8
    from radixlm.kernels.norm import fused_add_rmsnorm_, rmsnorm, rmsnorm_fp8
    from radixlm.kernels.rope import rope_and_store

    linear, gate_up_silu, fp8_linear, fp8_gate_up_silu, tuner = _skinny_linears(silu_and_mul, silu_and_mul_fp8)
    return KernelOps(
        "triton",
        rmsnorm,
        fused_add_rmsnorm_,
        silu_and_mul,
        rope_and_store,
        linear,
        gate_up_silu,
        fp8_linear,
        fp8_gate_up_silu,
        fp8_rows_of(rmsnorm_fp8),
        tuner,
    )


def flashinfer_ops() -> KernelOps:
    """FlashInfer's norm and activation kernels with our fused rope + KV store (FlashInfer's rope does not
    write the cache, so ours saves a pass over K and V)."""
    import flashinfer

    from radixlm.kernels.activation import silu_and_mul_fp8
    from radixlm.kernels.norm import rmsnorm_fp8
    from radixlm.kernels.rope import rope_and_store

    def fused_add(x, residual, weight, eps):
        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    linear, gate_up_silu, fp8_linear, fp8_gate_up_silu, tuner = _skinny_linears(
        flashinfer.activation.silu_and_mul, silu_and_mul_fp8
    )
    return KernelOps(
        "flashinfer",
        lambda x, w, eps: flashinfer.norm.rmsnorm(x, w, eps),
        fused_add,
        flashinfer.activation.silu_and_mul,
        rope_and_store,
        linear,
        gate_up_silu,
        fp8_linear,
        fp8_gate_up_silu,
        fp8_rows_of(rmsnorm_fp8),  # FlashInfer's norms write bf16 only: ours, where the projection after is FP8
        tuner,
    )


def select_kernel_ops(name: str, device: torch.device) -> KernelOps:
    """`auto`: Triton on CUDA when installed, else the torch references."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if name == "flashinfer":
        return flashinfer_ops()
    try:
        return triton_ops()
    except ImportError:
        if name == "triton":
            raise
        return TORCH_OPS


def tune_skinny_linears(ops: KernelOps, model) -> list[str]:
    """Times our GEMV kernels against cuBLAS once per distinct projection shape of `model` (CUDA only)."""
    if ops.tuner is None:
        return []
    from radixlm.srt.layers.basic import Linear
    from radixlm.srt.layers.quantization.fp8 import Fp8Linear

    shapes: dict[tuple[int, int, bool, bool], tuple[torch.Tensor, torch.Tensor | None]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        fused = name.endswith("gate_up_proj")
        if isinstance(module.quant, Fp8Linear):
            w = module.quant.weight
            shapes.setdefault((*w.shape, fused, True), (w, module.quant.scale.reshape(-1)))
        elif module.quant is None and module.weight.numel():
            shapes.setdefault((*module.weight.shape, fused, False), (module.weight, None))
    head = model.lm_head_weight
    if getattr(model, "lm_head_quant", None) is None and head.numel():
        shapes.setdefault((*head.shape, False, False), (head, None))
    return ops.tuner.tune([(w, key[2], scale) for key, (w, scale) in shapes.items()])
