"""FP8 (e4m3) linears: W8A8 with a scale per output channel for the weight and one per token for the activation.

y = (x_q * s_x) @ (W_q * s_w).T, computed by `torch._scaled_mm` with both scales applied to the fp32 accumulator
(cuBLASLt on Hopper: twice bf16's tensor-core rate and half its weight bytes). The weight's scales are fixed at
load time (online from a bf16 checkpoint or random weights, or read from an FP8 checkpoint); the activation's are
computed per token from the data at every call, so nothing needs calibration. A scale is amax / 448 (e4m3's
largest finite value), so every value maps into range and the largest lands on it.

FP8 checkpoints as users download them:
- compressed-tensors (`quant_method: compressed-tensors`, RedHatAI/neuralmagic FP8 models): `weight` in e4m3 and
  `weight_scale` per output channel ([N, 1]) or per tensor ([1]);
- Hugging Face's `fp8` method with block scales (`weight_block_size` [128, 128]): `weight` in e4m3 and
  `weight_scale_inv` per 128 x 128 block, the factor that multiplies the stored values back. Blocks are folded
  into per-channel scales at load: each block is dequantized and every row requantized with its own scale (an
  extra rounding of at most half an e4m3 step, measured in tests/srt/test_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels import next_pow2

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale (its values stay zero)


def fp8_supported(device: torch.device) -> str | None:
    """Why FP8 linears cannot run on `device`, or None when they can (tensor cores with FP8: compute 8.9+)."""
    if device.type != "cuda":
        return f"--quantization fp8 runs on CUDA GPUs with FP8 tensor cores (Ada or Hopper), not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9+); {name} is {major}.{minor}"
    if not hasattr(torch, "_scaled_mm"):
        return "--quantization fp8 needs torch._scaled_mm (torch 2.5 or newer)"
    return None


def scaled_gemm_rows(m: int) -> int:
    """The rows to run the scaled GEMM at for `m` rows (decode batches and short extends; past 256 rows, as they
    are). cuBLASLt's pick for a row count just past a power of two is slow: on an H200, every 70B projection took
    1.3-1.8x longer at 129-160 rows than at 256, and 1.1-1.2x at 65 rows than at 128 (tools/scaled_mm_rows.py).
    Such batches run padded to the power of two, which is also the row count the skinny-matmul tuner timed the
    scaled GEMM at: the lower 7/8 of (128, 256] and the lower 5/8 of (32, 64] and (64, 128], where padding
    measured faster on most projections; above that, the batch's own rows measured faster."""
    if m <= 32 or m > 256:
        return m
    top = next_pow2(m)
    return top if 8 * m <= (7 if top == 256 else 5) * top else m


def quantize_rows(w: torch.Tensor, rows_per_pass: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scales [N]) with w ~ q * scale[:, None]. A few thousand rows at a time:
    the float32 temporaries of a 70B model's gate_up projection whole would be 1.9 GB."""
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for lo in range(0, w.shape[0], rows_per_pass):
        part = w[lo : lo + rows_per_pass].detach()
        s = (part.abs().amax(dim=1).float() / FP8_MAX).clamp_min(_MIN_SCALE)
        q[lo : lo + rows_per_pass] = (part.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[lo : lo + rows_per_pass] = s
    return q, scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): one scale per token, from the data."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_min(_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().reshape(-1, 1)


def fold_block_scales(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled e4m3 weight (HF `fp8`: `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]) as per-channel e4m3."""
    n, k = q.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"block scales of shape {tuple(scale_inv.shape)} for a {n}x{k} weight in {bn}x{bk} blocks (expected {want})"
        )
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return quantize_rows(q.float() * full)


def channel_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A checkpoint's weight scale as one float32 per output channel: [N, 1] or [N] per channel, [1] or a scalar
    per tensor; any other shape is an error naming the tensor."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1).expand(rows).contiguous()
    if s.numel() == rows and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
        return s.reshape(rows).contiguous()
    raise ValueError(
        f"{name}: a weight scale of shape {tuple(s.shape)} fits neither per-tensor nor per-channel "
        f"scaling of {rows} output channels"
    )


@dataclass(eq=False)
class Fp8Rows:
    """Activations already in e4m3 with a float32 scale per token (a norm that quantized for the projection after
    it, kernels/norm.py:rmsnorm_fp8); `dtype` is what the projection returns, the dtype the rows came from."""

    q: torch.Tensor  # [T, K] e4m3
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return self.q.dim()


@dataclass(eq=False)
class Fp8Linear:
    """x @ W.T with W in e4m3 (row-major [N, K]) and a float32 scale per output row; x's dtype out."""

    weight: torch.Tensor
    scale: torch.Tensor  # [N]
    scaled = True  # e4m3 weight with per-row scales: the op set may run it through its own kernels

    def __post_init__(self) -> None:
        n, k = self.weight.shape
        if self.weight.dtype != FP8:
            raise ValueError(f"an FP8 linear's weight must be {FP8}, got {self.weight.dtype}")
        if k % 16 or n % 16:
            raise ValueError(f"FP8 GEMMs need both weight dimensions divisible by 16, got {n}x{k}")
        self.scale = self.scale.float().reshape(1, n).contiguous()

    @classmethod
    def from_weight(cls, w: torch.Tensor) -> Fp8Linear:
        return cls(*quantize_rows(w))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def matmul(self, x: torch.Tensor | Fp8Rows, rows: int | None = None) -> torch.Tensor:
        """x @ W.T through the scaled GEMM, run at `rows` rows (default: `scaled_gemm_rows` on CUDA, the batch's
        own elsewhere), the batch's rows then zeros."""
        if isinstance(x, Fp8Rows):  # quantized per token already, by the kernel that produced it
            xq, xs, dtype, lead = x.q, x.scale, x.dtype, x.shape[:-1]
        else:
            dtype, lead, k = x.dtype, x.shape[:-1], x.shape[-1]
            if x.is_cuda:
                from radixlm.kernels.fp8_quant import quantize_tokens as fused  # noqa: PLC0415

                xq, xs = fused(x.reshape(-1, k))
            else:
                xq, xs = quantize_tokens(x.reshape(-1, k))
        out_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        m = xq.shape[0]
        if rows is None:
            rows = scaled_gemm_rows(m) if xq.is_cuda else m
        if rows > m:  # the batch's rows, then zero rows with unit scales: their outputs are sliced off below
            xq_rows, xs_rows = xq.new_empty(rows, xq.shape[1]), xs.new_empty(rows, 1)
            xq_rows[:m], xs_rows[:m] = xq, xs.reshape(m, 1)
            xq_rows[m:].zero_()
            xs_rows[m:].fill_(1.0)
            xq, xs = xq_rows, xs_rows
        # scale_b [1, N] with scale_a [M, 1]: cuBLASLt's row-wise scaling, applied to the fp32 accumulator
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, out_dtype=out_dtype)[:m]
        return y.to(dtype).reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        return self.weight.numel() + 4 * self.scale.numel()

    def dequantize(self) -> torch.Tensor:
        return dequantize_rows(self.weight, self.scale)
