"""The all-reduce of a decode step's row-parallel outputs fused with the norm after it, on the GPUs of one host
(kernels/allreduce_norm.py): a rank's buffer lives in symmetric memory (torch.distributed._symmetric_memory),
mapped into every peer's address space, and one kernel pushes the rank's rows to its peers, waits for theirs,
sums, adds the residual and normalizes (quantizing for an FP8 projection). NCCL's all-reduce followed by a norm
kernel is two launches and world_size - 1 ring rounds of latency at the sizes where latency is the whole cost
(a decode step's 8-16 KiB rows); larger tensors (prefill, or past `per_peer_bytes`) stay on NCCL.

Every rank makes the same decision (set up and probed, or NCCL for everything): a rank that used the kernel
while a peer did not would wait for that peer's flags forever."""

from __future__ import annotations

import logging

import torch

from radixlm.kernels.allreduce_norm import GRID_MAX, allreduce_rmsnorm, buffer_bytes

logger = logging.getLogger(__name__)

# Rows pushed to each peer per call (bytes), up to where the fused kernel measured faster than NCCL's all-reduce
# and the norm kernel (benchmarks/gpu/bench_allreduce_norm.py, 4 x H200 NVLink). At tp 2 it led at every decode
# batch measured (4 MiB: a 70B batch of 256 rows). At tp 4 pushing every row to every peer (one-shot: three
# copies, where NCCL's ring moves about 1.5) led up to 256 KiB of rows and lost past it (8192 x 64: 23.5 against
# 19.9 us); past TWO_SHOT_PAST bytes the rows are reduced two-shot instead (each by one owner rank, which sends
# the sum back: 1.5 copies in two flag rounds), which led NCCL up to the 128 rows measured (8192 x 64: 17.8 us,
# x 128: 25.7 against 29.3; at 4096 x 128 even) and trailed one-shot at 256 KiB and below by 1-12%. MAX_ROWS caps
# the rows where no larger count was measured. No entry (NCCL for everything) where no measurement was made: 8
# GPUs.
PER_PEER_BYTES = {2: 4 << 20, 4: 2 << 20}
MAX_ROWS = {4: 128}
TWO_SHOT_PAST = {4: 256 << 10}
_DTYPES = (torch.bfloat16, torch.float16)

# Group names this process has mapped symmetric memory for. torch keeps what a rendezvous learned about a group
# by its name, and a later group (another in-process Engine after the first shut down) gets the same name from
# torch's counter: its rendezvous then waited minutes on the old group's store (seen on 4 x H200) before the
# ranks fell back to NCCL. A reused name goes straight to NCCL instead.
_MAPPED: set[str] = set()


class AllReduceNorm:
    """One rank's end of the fused all-reduce + norm. `peers`: every rank's buffer (kernels/allreduce_norm.py's
    layout, zeroed before any rank's first call) as addressed from this process; the buffers themselves are the
    caller's (symmetric memory on GPUs: `setup`), kept alive here through `keep`. Every rank of the group makes
    the same calls in the same order."""

    def __init__(
        self, rank: int, world: int, peers: torch.Tensor, per_peer_bytes: int, grid_max: int,
        max_rows: int | None = None, keep=(), two_shot_past: int | None = None,
    ):  # fmt: skip
        self.rank, self.world, self.peers = rank, world, peers
        self.per_peer_bytes, self.grid_max = per_peer_bytes, grid_max
        self.max_rows: int | None = max_rows  # None: as many rows as the buffer holds
        self.two_shot_past: int | None = two_shot_past  # bytes of rows past which a call is two-shot; None: never
        self.state = torch.tensor([1, 0], dtype=torch.int64, device=peers.device)  # [epoch, programs done]
        self._keep = keep

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.dtype in _DTYPES
            and x.stride(1) == 1
            and 0 < x.shape[0]
            and (self.max_rows is None or x.shape[0] <= self.max_rows)
            and x.shape[0] * x.shape[1] * x.element_size() <= self.per_peer_bytes
        )

    def __call__(self, x, residual, weight, eps, quant: bool = False, two_shot: bool | None = None):
        """(rmsnorm(sum over ranks of x + residual), residual) with x overwritten, or (e4m3 rows, scales,
        residual) with `quant`; residual is updated in place (kernels/allreduce_norm.allreduce_rmsnorm).
        `two_shot`: the scheme (default: two-shot past `two_shot_past` bytes of rows)."""
        if two_shot is None:
            two_shot = self.two_shot_past is not None and x.numel() * x.element_size() > self.two_shot_past
        return allreduce_rmsnorm(
            x, residual, weight, eps, self.peers, self.state, self.rank, self.world, self.per_peer_bytes,
            self.grid_max, quant, two_shot,
        )  # fmt: skip


def setup(tp, device: torch.device) -> AllReduceNorm | None:
    """An AllReduceNorm for this rank's group, or None (NCCL and the norm kernels for everything) when the
    group's size has no entry, the GPUs cannot map each other's memory, or a probe gives a wrong sum; the ranks
    agree either way."""
    import torch.distributed as dist

    per_peer = PER_PEER_BYTES.get(tp.size)
    if per_peer is None:
        return None

    def everyone(ok: bool) -> bool:
        return bool(tp.all_reduce_min(int(ok)))

    # every program of a call must be resident at once (they wait for each other across ranks): a quarter of the
    # SMs stays free for kernels of other streams or processes that could otherwise hold them
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    grid_max = min(GRID_MAX, tp.all_reduce_min(sms * 3 // 4))
    buf, why = None, ""
    if tp.group.group_name in _MAPPED:
        why = f"group name {tp.group.group_name!r} was mapped earlier in this process"
    else:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(buffer_bytes(tp.size, per_peer, grid_max), dtype=torch.uint8, device=device)
            buf.zero_()  # flags start below every epoch
        except Exception as e:  # noqa: BLE001 - any failure means NCCL, on every rank
            why = f"{type(e).__name__}: {e}"
    if not everyone(buf is not None):
        logger.info("tensor parallel: NCCL for every all-reduce (symmetric memory unavailable%s)", why and f": {why}")
        return None
    ok = True
    _MAPPED.add(tp.group.group_name)
    try:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        # Needed by older torch only; newer ones mark it deprecated.
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(tp.group.group_name)
        handle = symm_mem.rendezvous(buf, tp.group.group_name)  # maps every peer's buffer (a collective)
        ptrs = list(handle.buffer_ptrs)
        if ptrs[tp.rank] != buf.data_ptr():  # the kernel addresses its own buffer through `peers` too
            raise RuntimeError(f"rank {tp.rank}'s mapped buffer is at {ptrs[tp.rank]:#x}, not {buf.data_ptr():#x}")
        peers = torch.tensor(ptrs, dtype=torch.int64, device=device)
        fused = AllReduceNorm(
            tp.rank,
            tp.size,
            peers,
            per_peer,
            grid_max,
            MAX_ROWS.get(tp.size),
            (buf, handle),
            TWO_SHOT_PAST.get(tp.size),
        )
        dist.barrier(group=tp.group)  # every peer's flags are zero before anyone pushes
        ok, why = _probe(fused, tp, device)
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"{type(e).__name__}: {e}"
    if not everyone(ok):
        logger.warning("tensor parallel: NCCL for every all-reduce (the fused all-reduce failed: %s)", why)
        return None
    logger.info(
        "tensor parallel: decode all-reduces fused with the norm after them (symmetric memory, up to %d KiB a peer)",
        per_peer >> 10,
    )
    return fused


def _probe(fused: AllReduceNorm, tp, device) -> tuple[bool, str]:
    """Two calls (both parities) of each scheme the group uses, whose sums are known: rank r contributes r + 1
    to every element, so the residual stream becomes residual + world * (world + 1) / 2 on every rank. Every
    call is made whatever an earlier one gave: a rank that stopped at a wrong sum would leave its peers waiting
    in the next call for flags that never come (two-shot ranks take different paths, so one rank alone can be
    wrong), where the ranks must instead agree to fall back to NCCL."""
    n = 1024
    w = torch.ones(n, dtype=torch.bfloat16, device=device)
    want = 1 + tp.size * (tp.size + 1) / 2
    why = ""
    for two_shot in (False, False, True, True) if fused.two_shot_past is not None else (False, False):
        x = torch.full((4, n), float(tp.rank + 1), dtype=torch.bfloat16, device=device)
        residual = torch.ones(4, n, dtype=torch.bfloat16, device=device)
        _, residual = fused(x, residual, w, 1e-6, two_shot=two_shot)
        if not why and not bool((residual == want).all().item()):
            scheme = "two-shot" if two_shot else "one-shot"
            why = f"the {scheme} probe's sum was {residual.flatten()[0].item()}, expected {want}"
    return not why, why
