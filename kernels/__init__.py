"""Triton kernels (and thin FlashInfer wrappers), each beside the torch reference it is tested against.

Everything here imports without Triton; `HAS_TRITON` says whether the kernels can run. On CPU they run under
`TRITON_INTERPRET=1`, which is how CI tests them.
"""

from __future__ import annotations

from radixlm.srt import env

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # the CPU install has no Triton; the torch references still work
    HAS_TRITON = False

INTERPRET = env.TRITON_INTERPRET.get()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype) -> str:
    """fp32 tiles multiply in full precision (Triton's default would round them to TF32 on the GPU)."""
    import torch

    return "ieee" if dtype == torch.float32 else "tf32"
