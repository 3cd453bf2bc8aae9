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

With `two_shot` (groups of four and more, where one rank pushing every row to every peer moves world - 1 copies
of the tensor) each program's rows have an owner, rank `pid % world`: the other ranks push their rows to the
owner only (step 1 to the owner), the owner waits for them and sums in rank order, then pushes the rounded sum to
every peer's slot for its own rank and raises their flags; the others wait for the owner's flag and take the sum
from there. A rank then moves 2 (world - 1) / world copies in two flag rounds instead of world - 1 in one, and
every rank still adds the same rounded sum to the same residual. A flag slot has one writer and is written at most
once a call, with that call's epoch (two-shot writes a peer's slot at the owner in the first round and the
owner's slot at a peer in the second, and leaves the rest), and a rank waits only on the slots its scheme
writes in that call, so calls of both schemes can follow each other.

Calls are counted on the device (`state`: [epoch, programs done]; the last program of a call advances the
epoch), so the kernel replays in CUDA graphs. Two parities are enough: a peer can be at most one call ahead,
since it cannot finish a call before this rank has pushed for it (one-shot: to it; two-shot: to the owners,
whose sums the peer waits for). Flags only grow, so a flag already past this
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
def _ptr(peers_ptr, r, ty):
    return tl.load(peers_ptr + r).to(tl.pointer_type(ty))


@triton.jit
def _raise(peers_ptr, r, slot, epoch):
    """Raise flag `slot` in rank r's buffer to `epoch`: a release store at system scope (after a block barrier,
    so that every thread's pushes before it are released with it)."""
    tl.atomic_xchg(_ptr(peers_ptr, r, tl.int64) + slot, epoch, sem="release", scope="sys")


@triton.jit
def _wait(flags, slot, epoch):
    while tl.atomic_add(flags + slot, 0, sem="acquire", scope="sys") < epoch:
        pass


@triton.jit
def _rank_sum(x_ptr, own_data, row, stride_x, slot0, rank, rows_cap, n_cols, cols, mask, WORLD: tl.constexpr):
    """Every rank's partial row in rank order, summed in float32 and rounded to the activation dtype once: this
    rank's from x, the peers' from this rank's data region (`slot0`: the parity's first slot)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == rank:
            v = tl.load(x_ptr + tl.cast(row, tl.int64) * stride_x + cols, mask=mask, other=0.0)
        else:
            src = own_data + ((slot0 + r) * rows_cap + row) * n_cols
            v = tl.load(src + cols, mask=mask, other=0.0, cache_modifier=".cg")
        acc += v.to(tl.float32)
    return acc.to(x_ptr.dtype.element_ty)


@triton.jit
def _add_norm(s, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, row64, stride_res, stride_out, cols, mask, n_cols, eps,
              QUANT: tl.constexpr):  # fmt: skip
    """The residual add and the norm of a summed row, as the norm kernel rounds them."""
    res = tl.load(res_ptr + row64 * stride_res + cols, mask=mask, other=0.0)
    h = (s.to(tl.float32) + res.to(tl.float32)).to(res.dtype)
    tl.store(res_ptr + row64 * stride_res + cols, h, mask=mask)
    norm_row_store(h, w_ptr, out_ptr, q_ptr, s_ptr, row64, stride_out, cols, mask, n_cols, eps, QUANT)


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
    TWO_SHOT: tl.constexpr,
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
    slot0 = parity * WORLD  # this call's slots: [parity, source rank, row]
    own_flags = _ptr(peers_ptr, rank, tl.int64)
    # the buffers' addresses come from memory: say they are 16-byte aligned so that rows move in vectors (the
    # hint does not survive a helper function's return, hence written out at each use)
    own_data = tl.multiple_of(tl.load(peers_ptr + rank).to(tl.pointer_type(dtype)), 16) + data_off
    flag = pid * WORLD  # this program's flags, one per source rank

    if TWO_SHOT:
        owner = pid % WORLD
        if rank != owner:
            # 1. this program's rows to the owner only; 2. the owner's sum back
            dst = tl.multiple_of(tl.load(peers_ptr + owner).to(tl.pointer_type(dtype)), 16) + data_off
            for row in range(pid, n_rows, grid):
                row64 = tl.cast(row, tl.int64)
                x = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0)
                tl.store(dst + ((slot0 + rank) * rows_cap + row) * n_cols + cols, x, mask=mask)
            tl.debug_barrier()
            _raise(peers_ptr, owner, flag + rank, epoch)
            _wait(own_flags, flag + owner, epoch)
            tl.debug_barrier()
            for row in range(pid, n_rows, grid):
                row64 = tl.cast(row, tl.int64)
                src = own_data + ((slot0 + owner) * rows_cap + row) * n_cols
                s = tl.load(src + cols, mask=mask, other=0.0, cache_modifier=".cg")
                _add_norm(s, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, row64, stride_res, stride_out, cols, mask,
                          n_cols, eps, QUANT)  # fmt: skip
        else:
            # 1. every peer's rows for this program; 2. their sum to every peer (kept in x for the norm below)
            for r in tl.static_range(WORLD):
                if r != rank:
                    _wait(own_flags, flag + r, epoch)
            tl.debug_barrier()
            for row in range(pid, n_rows, grid):
                row64 = tl.cast(row, tl.int64)
                s = _rank_sum(x_ptr, own_data, row, stride_x, slot0, rank, rows_cap, n_cols, cols, mask, WORLD)
                for r in tl.static_range(WORLD):
                    if r != rank:
                        dst = tl.multiple_of(tl.load(peers_ptr + r).to(tl.pointer_type(dtype)), 16) + data_off
                        tl.store(dst + ((slot0 + rank) * rows_cap + row) * n_cols + cols, s, mask=mask)
                tl.store(x_ptr + row64 * stride_x + cols, s, mask=mask)
            tl.debug_barrier()
            for r in tl.static_range(WORLD):
                if r != rank:
                    _raise(peers_ptr, r, flag + rank, epoch)
            for row in range(pid, n_rows, grid):
                row64 = tl.cast(row, tl.int64)
                s = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0)
                _add_norm(s, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, row64, stride_res, stride_out, cols, mask,
                          n_cols, eps, QUANT)  # fmt: skip
    else:
        # 1. this program's rows into every peer's slot for them
        for row in range(pid, n_rows, grid):
            row64 = tl.cast(row, tl.int64)
            x = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0)
            for r in tl.static_range(WORLD):
                if r != rank:
                    dst = tl.multiple_of(tl.load(peers_ptr + r).to(tl.pointer_type(dtype)), 16) + data_off
                    tl.store(dst + ((slot0 + rank) * rows_cap + row) * n_cols + cols, x, mask=mask)
        tl.debug_barrier()
        for r in tl.static_range(WORLD):
            if r != rank:
                _raise(peers_ptr, r, flag + rank, epoch)
        # 2. every peer's rows for this program have arrived (from the peer's program of the same index)
        for r in tl.static_range(WORLD):
            if r != rank:
                _wait(own_flags, flag + r, epoch)
        tl.debug_barrier()
        # 3. the sum in rank order, the residual add and the norm
        for row in range(pid, n_rows, grid):
            row64 = tl.cast(row, tl.int64)
            s = _rank_sum(x_ptr, own_data, row, stride_x, slot0, rank, rows_cap, n_cols, cols, mask, WORLD)
            _add_norm(s, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr, row64, stride_res, stride_out, cols, mask, n_cols,
                      eps, QUANT)  # fmt: skip

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
    two_shot: bool = False,
):
    """x [T, N]: this rank's partial sums (unit stride along N; overwritten: with the normed rows unless
    `quant`, with the sums where this rank owns them under `two_shot`); residual [T, N] updated in place.
    Returns (normed rows, residual), or (e4m3 rows, float32 scales [T, 1], residual) with `quant`. Every rank of
    the group must make the same call, and T * N * itemsize <= per_peer_bytes. One program per row, at most
    `grid_max` (programs loop over rows). `two_shot`: each program's rows reduced by one owner rank and sent
    back (the module's docstring); every rank of the group must pass the same."""
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
        TWO_SHOT=two_shot,
        BLOCK=block,
        num_warps=warps,
        **pdl_args(x.device),
    )
    return (q, scale, residual) if quant else (out, residual)
