"""The all-reduce after a row-parallel projection (o, down) fused with the residual add and RMSNorm that follow
it (and the per-token e4m3 quantization an FP8 projection after the norm takes): one kernel instead of an NCCL
all-reduce, a norm and a quantization, for the decode-sized tensors of one host's GPUs.

Each rank's buffer (symmetric memory: mapped into every peer's address space, `peers` holds every rank's base
address) has a flag region [grid_max, world] int64 and a data region [2, world, rows_cap, n] in the activation
dtype. A call:
1. pushes each of its rows into every peer's data region (slot: this call's parity, this rank, the row) over
   NVLink, and after a block barrier raises its flag in every peer (a release store at system scope);
2. waits until every peer's flag for this program reached this call's epoch (acquire loads of its own flags);
3. sums the rows in rank order in float32 (its own from x, the peers' from its own data region), so that every
   rank computes the same bits, then adds the residual and normalizes as the norm kernel does.

Calls are counted on the device (`state`: [epoch, programs done]; the last program of a call advances the
epoch), so the kernel replays in CUDA graphs. Two parities are enough: a peer can be at most one call ahead,
since it cannot finish a call before this rank has pushed to it. Flags only grow, so a flag already past this
call's epoch (a fast peer's next call) still releases the wait. Every program of a grid must be resident at
once (they wait for each other across ranks), so the grid is at most `grid_max`, below the SM count, and
programs loop over rows."""

from __future__ import annotations

import torch

from radixlm.kernels import next_pow2
from radixlm.kernels._triton import gdc_launch_dependents, gdc_wait, pdl_args, tl, triton
from radixlm.kernels.norm import fused_add_rmsnorm_ref, norm_row_store, rmsnorm_fp8_ref

# The buffer's data region starts here (bytes after the flags, rounded to 256) for a grid of at most this many
# programs: below the SM count of every GPU this serves (A100 108, H100 132, H200 132).
GRID_MAX = 96


def flag_bytes(world: int, grid_max: int = GRID_MAX) -> int:
    return -(-(grid_max * world * 8) // 256) * 256


def buffer_bytes(world: int, per_peer_bytes: int, grid_max: int = GRID_MAX) -> int:
    """A rank's symmetric buffer: the flags, then two parities of `world` slots of `per_peer_bytes`."""
    return flag_bytes(world, grid_max) + 2 * world * per_peer_bytes


# --- torch reference -----------------------------------------------------------------------------------------
def allreduce_rmsnorm_ref(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False
):
    """What every rank computes from every rank's partial rows (in rank order): (rmsnorm(sum + residual), the
    new residual), or (e4m3 rows, scales, the new residual) with `quant`. The sum is taken in float32 and
    rounded to the activation dtype once."""
    total = partials[0].float()
    for p in partials[1:]:
        total = total + p.float()
    s = total.to(partials[0].dtype)
    if quant:
        return rmsnorm_fp8_ref(s, residual.clone(), weight, eps)
    return fused_add_rmsnorm_ref(s, residual, weight, eps)


# --- Triton --------------------------------------------------------------------------------------------------
@triton.jit
def _allreduce_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    q_ptr,
    s_ptr,
    peers_ptr,
    state_ptr,
    n_rows,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    rank,
    rows_cap,
    data_off,
    WORLD: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(state_ptr, volatile=True)
    parity = epoch % 2
    own_flags = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int64))
    # the buffers' addresses come from memory: say they are 16-byte aligned so that rows move in vectors
    own_data = tl.multiple_of(tl.load(peers_ptr + rank).to(tl.pointer_type(dtype)), 16) + data_off

    # 1. this program's rows into every peer's slot for them
    for row in range(pid, n_rows, grid):
        x = tl.load(x_ptr + tl.cast(row, tl.int64) * stride_x + cols, mask=mask, other=0.0)
        slot = ((parity * WORLD + rank) * rows_cap + row) * n_cols
        for r in tl.static_range(WORLD):
            if r != rank:
                peer = tl.multiple_of(tl.load(peers_ptr + r).to(tl.pointer_type(dtype)), 16) + data_off
                tl.store(peer + slot + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's stores issued before the flag that releases them
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(peers_ptr + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + pid * WORLD + rank, epoch, sem="release", scope="sys")

    # 2. every peer's rows for this program have arrived (from the peer's program of the same index)
    for r in tl.static_range(WORLD):
        if r != rank:
            while tl.atomic_add(own_flags + pid * WORLD + r, 0, sem="acquire", scope="sys") < epoch:
                pass
    tl.debug_barrier()

    # 3. the sum in rank order, the residual add and the norm
    for row in range(pid, n_rows, grid):
        row64 = tl.cast(row, tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == rank:
                v = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0)
            else:
                src = own_data + ((parity * WORLD + r) * rows_cap + row) * n_cols
                v = tl.load(src + cols, mask=mask, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        res = tl.load(res_ptr + row64 * stride_res + cols, mask=mask, other=0.0)
        # as the norm kernel: the sum rounded to the activation dtype, the residual add rounded again
        h = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(res.dtype)
        tl.store(res_ptr + row64 * stride_res + cols, h, mask=mask)
        norm_row_store(h, w_ptr, out_ptr, q_ptr, s_ptr, row64, stride_out, cols, mask, n_cols, eps, QUANT)

    # the call's last program advances the epoch for the next call (kernel order makes it visible there)
    done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == grid - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, epoch + 1)


def allreduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    peers: torch.Tensor,
    state: torch.Tensor,
    rank: int,
    world: int,
    per_peer_bytes: int,
    grid_max: int = GRID_MAX,
    quant: bool = False,
):
    """x [T, N]: this rank's partial sums (unit stride along N; overwritten with the normed rows unless
    `quant`); residual [T, N] updated in place. Returns (normed rows, residual), or (e4m3 rows, float32 scales
    [T, 1], residual) with `quant`. Every rank of the group must make the same call, and
    T * N * itemsize <= per_peer_bytes. One program per row, at most `grid_max` (programs loop over rows)."""
    t, n = x.shape
    rows_cap = per_peer_bytes // (n * x.element_size())
    if not 0 < t <= rows_cap:
        raise ValueError(f"{t} rows of {n} do not fit the all-reduce buffer ({rows_cap} rows)")
    q = scale = None
    if quant:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    grid = min(t, grid_max)
    out = x  # a program writes its normed rows over the partial rows it pushed and summed itself
    block = next_pow2(n)
    warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    _allreduce_rmsnorm_kernel[(grid,)](
        x,
        residual,
        weight,
        out,
        q if quant else out,
        scale if quant else out,
        peers,
        state,
        t,
        x.stride(0),
        residual.stride(0),
        (q if quant else out).stride(0),
        n,
        eps,
        rank,
        rows_cap,
        flag_bytes(world, grid_max) // x.element_size(),
        WORLD=world,
        QUANT=quant,
        BLOCK=block,
        num_warps=warps,
        **pdl_args(x.device),
    )
    return (q, scale, residual) if quant else (out, residual)
