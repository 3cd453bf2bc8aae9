"""A rank's place in its tensor-parallel group and the two collectives a sharded Llama needs: the all-reduce
after each row-parallel projection (o, down, the vocab-parallel embedding) and the all-gather of the
vocab-parallel logits. gloo on CPU, NCCL on GPUs, both through torch.distributed.

How a model splits across `size` ranks (the peers' layout): query heads and MLP columns evenly; KV heads evenly
when there are at least as many as ranks, else each KV head is replicated on size / kv_heads consecutive ranks;
the vocabulary in contiguous ranges of ceil(V / size) rows (the last range padded with zero rows).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1
    # GPUs of one host: the all-reduce fused with the norm after it (fused_all_reduce.AllReduceNorm), or None
    fused: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (x itself when size is 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value` (a start-up decision all ranks must share)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device="cuda" if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (a picklable start-up decision)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        # One collective into one buffer (capturable in a CUDA graph): rank blocks stacked along the first dimension
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
        gather(out, x, group=self.group)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    # --- the layout --------------------------------------------------------------------------------------------
    def even(self, n: int, what: str) -> int:
        """n / size, or a ValueError naming what does not split."""
        if n % self.size:
            raise ValueError(f"tp_size {self.size} does not divide the model's {n} {what}")
        return n // self.size

    def kv_heads(self, kv_heads: int) -> tuple[int, int]:
        """(KV heads on this rank, index of its first KV head in the checkpoint)."""
        if kv_heads >= self.size:
            local = self.even(kv_heads, "KV heads")
            return local, self.rank * local
        if self.size % kv_heads:
            raise ValueError(
                f"tp_size {self.size} neither divides nor is a multiple of the model's {kv_heads} KV heads"
            )
        return 1, self.rank // (self.size // kv_heads)

    def vocab_range(self, vocab: int) -> tuple[int, int, int]:
        """(first row, rows held, rows that are real) of this rank's vocabulary range."""
        per = -(-vocab // self.size)
        start = self.rank * per
        return start, per, max(0, min(vocab, start + per) - start)


SINGLE = TensorParallel()


@dataclass(frozen=True)
class PartialSum:
    """A row-parallel projection's output before its all-reduce: this rank's share of every row. The norm it
    feeds sums it across ranks in its own kernel where one exists (RMSNorm), else `reduced()` first."""

    x: torch.Tensor
    tp: TensorParallel

    def reduced(self) -> torch.Tensor:
        return self.tp.all_reduce(self.x)


# How long a collective of the model's group may wait: rank 0 may tune kernels for minutes at start-up while the
# others wait for its picks, and a served step waits for the slowest rank. A rank that dies is noticed by
# ranks.watch_workers, not by this timeout.
_COLLECTIVE_TIMEOUT = datetime.timedelta(hours=1)


def init_tensor_parallel(size: int, rank: int, init_method: str, backend: str, timeout_s: float) -> TensorParallel:
    """Join the group and prove it works with one all-reduce, within `timeout_s` seconds: start-up most often
    hangs in this first collective (a wrong address or network interface), and a bounded wait turns that hang
    into an error that names the likely cause. The model's collectives then run in a group of their own, whose
    timeout is long (_COLLECTIVE_TIMEOUT)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank, timeout=timeout)
        probe = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(probe)
        group = dist.new_group(backend=backend, timeout=_COLLECTIVE_TIMEOUT)
        dist.all_reduce(probe, group=group)
    except Exception as e:  # noqa: BLE001 - the message is what matters here
        hint = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
        raise RuntimeError(
            f"tensor-parallel rank {rank} of {size} could not reach its group at {init_method} within "
            f"{timeout_s:.0f} s ({type(e).__name__}: {e}); check the address and that every rank started, "
            f"and set {hint} to the network interface the ranks share"
        ) from None
    if int(probe.item()) != size * size:
        raise RuntimeError(f"tensor-parallel preflight all-reduces gave {probe.item()}, expected {size * size}")
    logger.info("tensor parallel: rank %d of %d (%s)", rank, size, backend)
    return TensorParallel(size, rank, group)
