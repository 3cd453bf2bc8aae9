"""The all-reduce of small tensors (decode steps) on the GPUs of one host, over symmetric memory: every rank's
buffer is mapped into every peer's address space, and one kernel copies the rank's tensor into its buffer,
meets its peers at a barrier, reads and sums every peer's buffer over NVLink and meets them again
(torch's `symm_mem.one_shot_all_reduce_copy_out`). NCCL's ring needs world_size - 1 rounds of latency for the
same tensor; at the sizes of a decode step (batch x hidden x 2 bytes: 16 KiB to a few MiB) that latency is the
cost. Large tensors (prefill) stay on NCCL, whose bandwidth wins there.

Every rank makes the same decision (set up, probed, or not at all): a rank that used it while a peer did not
would wait at its barrier forever."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Largest tensor (bytes) the one-shot kernel takes, per group size: it reads world_size copies, so its advantage
# over NCCL's ring shrinks as the group grows (measured on H100/H200 NVLink; see benchmarks/results/README.md).
MAX_BYTES = {2: 4 << 20, 4: 2 << 20, 8: 1 << 20}
_DTYPES = (torch.bfloat16, torch.float32)  # the kernel's dispatch: no fp16


class SymmAllReduce:
    def __init__(self, group, device: torch.device, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.name = group.group_name
        self.max_bytes = max_bytes
        self.buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)

    def rendezvous(self) -> None:
        """Map every peer's buffer (a collective of the group)."""
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        # Needed by older torch only; newer ones mark it deprecated, and its cache by group name would outlive a
        # destroyed group whose name a later one reuses.
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(self.name)
        symm_mem.rendezvous(self.buf, self.name)

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in _DTYPES and x.is_contiguous() and nbytes <= self.max_bytes and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, written into x (each thread of the kernel reads its elements of x before it writes
        the same elements back)."""
        flat = x.view(-1)
        slot = self.buf[: flat.numel() * flat.element_size()].view(x.dtype)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(slot, flat, "sum", self.name, flat)
        return x


def setup(tp, device: torch.device):
    """A SymmAllReduce for this rank's group, or None (NCCL for everything) when the group's size has no entry,
    the GPUs cannot map each other's memory, or a probe all-reduce is wrong; the ranks agree either way."""
    import torch.distributed as dist

    max_bytes = MAX_BYTES.get(tp.size)
    if max_bytes is None:
        return None

    def everyone(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp.group)
        return bool(flag.item())

    fast, why = None, ""
    try:
        fast = SymmAllReduce(tp.group, device, max_bytes)
    except Exception as e:  # noqa: BLE001 - any failure means NCCL, on every rank
        why = f"{type(e).__name__}: {e}"
    if not everyone(fast is not None):
        logger.info("tensor parallel: NCCL for every all-reduce (symmetric memory unavailable%s)", why and f": {why}")
        return None
    ok = True
    try:
        fast.rendezvous()
        probe = torch.full((4096,), float(tp.rank + 1), dtype=torch.bfloat16, device=device)
        fast(probe)
        ok = bool((probe == tp.size * (tp.size + 1) / 2).all().item())
        why = "" if ok else "the probe's sum was wrong"
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"{type(e).__name__}: {e}"
    if not everyone(ok):
        logger.warning("tensor parallel: NCCL for every all-reduce (the one-shot all-reduce failed: %s)", why)
        return None
    logger.info("tensor parallel: one-shot all-reduce over symmetric memory up to %d KiB", max_bytes >> 10)
    return fast
