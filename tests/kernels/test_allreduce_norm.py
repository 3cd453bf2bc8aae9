"""The fused all-reduce + residual add + RMSNorm kernel (kernels/allreduce_norm.py) as rank 0 of a group of two,
in one process: the peer's buffer is a second tensor whose address stands in `peers`, and what the peer would
have pushed (its rows and its flags) is placed in rank 0's buffer before the call. Under TRITON_INTERPRET=1 the
kernel's pushes, flags, wait, sum and epoch count run as on a GPU; the wait cannot hang here because the
peer's flags are set first (a missing flag would hang the test, which the flag assertions below also catch).
Two GPUs run the real thing in tests/gpu/test_tp_cuda.py."""

from __future__ import annotations

import pickle

import pytest
import torch

from radixlm.kernels import HAS_TRITON
from radixlm.srt.utils import kill_on_parent_death
from tests.helpers import rel_err

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _setup(world, per_peer, grid_max):
    from radixlm.kernels.allreduce_norm import buffer_bytes

    bufs = [torch.zeros(buffer_bytes(world, per_peer, grid_max), dtype=torch.uint8) for _ in range(world)]
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    return bufs, peers


def _views(buf, world, per_peer, grid_max, n, dtype):
    """(flags [grid_max, world] int64, data [2, world, rows_cap, n]) of one rank's buffer."""
    from radixlm.kernels.allreduce_norm import flag_bytes

    fb = flag_bytes(world, grid_max)
    flags = buf[: grid_max * world * 8].view(torch.int64).view(grid_max, world)
    rows_cap = per_peer // (n * torch.finfo(dtype).bits // 8)
    data = buf[fb : fb + 2 * world * rows_cap * n * 2].view(dtype).view(2, world, rows_cap, n)
    return flags, data


@pytest.mark.skipif(DEV == "cuda", reason="one process stands in for two ranks only in the interpreter")
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("rows,n,grid_max", [(1, 96, 4), (5, 64, 2), (3, 576, 8)])
def test_rank0_of_two_pushes_flags_sums_and_norms(quant, rows, n, grid_max):
    from radixlm.kernels.allreduce_norm import allreduce_rmsnorm, allreduce_rmsnorm_ref

    world, per_peer, dtype = 2, 8 * 1024 * 2, torch.bfloat16
    bufs, peers = _setup(world, per_peer, grid_max)
    state = torch.tensor([1, 0], dtype=torch.int64)
    g = torch.Generator().manual_seed(rows * n)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    grid = min(rows, grid_max)  # one program per row, programs looping over rows past grid_max
    for call in range(3):  # three calls: both parities, the epoch counted on the "device"
        epoch = call + 1
        mine = torch.randn(rows, n, generator=g).to(dtype)
        peer = torch.randn(rows, n, generator=g).to(dtype)
        residual = torch.randn(rows, n, generator=g).to(dtype)
        flags0, data0 = _views(bufs[0], world, per_peer, grid_max, n, dtype)
        flags1, data1 = _views(bufs[1], world, per_peer, grid_max, n, dtype)
        data0[epoch % 2, 1, :rows] = peer  # what rank 1 pushed to rank 0 ...
        flags0[:grid, 1] = epoch  # ... and its flags
        want = allreduce_rmsnorm_ref([mine, peer], residual.clone(), w, 1e-6, quant=quant)
        x, res = mine.clone(), residual.clone()
        got = allreduce_rmsnorm(x, res, w, 1e-6, peers, state, 0, world, per_peer, grid_max, quant=quant)
        # rank 0's rows and flags reached rank 1's buffer, in this call's parity
        assert torch.equal(data1[epoch % 2, 0, :rows], mine)
        assert (flags1[:grid, 0] == epoch).all() and (flags1[grid:, 0] < epoch).all()
        assert state.tolist() == [epoch + 1, 0]
        # the residual stream: the rank-order sum plus the residual (to bf16 rounding: the interpreter truncates
        # where the GPU rounds; the test below checks the kernel bit for bit against the norm kernel)
        assert rel_err(got[-1], want[-1]) < 1e-2
        if quant:
            q, s, _ = got
            wq, ws, _ = want
            assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
            assert torch.allclose(s, ws, rtol=3e-2)  # bf16 truncation in the interpreter
        else:
            out, _ = got
            assert out.data_ptr() == x.data_ptr()  # in place, as fused_add_rmsnorm_
            assert rel_err(out, want[0]) < 1.5e-2


@pytest.mark.skipif(DEV == "cuda", reason="one process stands in for two ranks only in the interpreter")
def test_rank0_matches_the_norm_kernel_on_the_summed_rows():
    """Bit for bit what NCCL's sum (exact here: the peer's rows are zero) followed by the norm kernel gives."""
    from radixlm.kernels.allreduce_norm import allreduce_rmsnorm
    from radixlm.kernels.norm import fused_add_rmsnorm_

    world, per_peer, grid_max, rows, n, dtype = 2, 4096, 4, 3, 64, torch.bfloat16
    bufs, peers = _setup(world, per_peer, grid_max)
    flags0, _ = _views(bufs[0], world, per_peer, grid_max, n, dtype)
    flags0[:, 1] = 1
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, n, generator=g).to(dtype)
    r = torch.randn(rows, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    want, want_res = fused_add_rmsnorm_(x.clone(), r.clone(), w, 1e-6)
    state = torch.tensor([1, 0], dtype=torch.int64)
    got, res = allreduce_rmsnorm(x.clone(), r.clone(), w, 1e-6, peers, state, 0, world, per_peer, grid_max)
    assert torch.equal(res, want_res) and torch.equal(got, want)
    # and with the rows quantized for an FP8 projection, what the norm's e4m3 kernel gives
    from radixlm.kernels.norm import rmsnorm_fp8

    wq, ws, wres = rmsnorm_fp8(x.clone(), r.clone(), w, 1e-6)
    flags0[:, 1] = 2  # the peer's flags for the second call
    q, s, res = allreduce_rmsnorm(x.clone(), r.clone(), w, 1e-6, peers, state, 0, world, per_peer, grid_max, quant=True)
    assert state.tolist() == [3, 0]
    assert torch.equal(res, wres) and torch.equal(s, ws) and torch.equal(q.float(), wq.float())


def test_rows_past_the_buffer_are_refused():
    from radixlm.kernels.allreduce_norm import allreduce_rmsnorm

    x = torch.zeros(9, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        allreduce_rmsnorm(x, x.clone(), x[0], 1e-6, torch.zeros(2, dtype=torch.int64), torch.zeros(2), 0, 2, 8 * 64 * 2)


def test_the_runtime_takes_rows_up_to_its_byte_and_row_limits():
    """Which tensors go to the fused kernel rather than NCCL: within the buffer and, where a group size has a row
    cap (tp 4), within that too; and past which size a group of four reduces two-shot."""
    from radixlm.srt.distributed.fused_all_reduce import MAX_ROWS, PER_PEER_BYTES, TWO_SHOT_PAST, AllReduceNorm

    def rows(t, n, dtype=torch.bfloat16):
        return torch.empty(t, n, dtype=dtype)

    peers = torch.zeros(4, dtype=torch.int64)
    cap = MAX_ROWS[4]
    four = AllReduceNorm(0, 4, peers, PER_PEER_BYTES[4], 8, cap, two_shot_past=TWO_SHOT_PAST[4])
    assert four.takes(rows(cap, 8192)) and four.takes(rows(1, 4096)) and four.takes(rows(cap, 4096))
    assert not four.takes(rows(cap + 1, 4096)) and not four.takes(rows(2 * cap, 4096))  # the row cap
    assert not four.takes(rows(PER_PEER_BYTES[4] // (8192 * 2) + 1, 8192))  # past the buffer
    assert not four.takes(rows(4, 4096, torch.float32)) and not four.takes(rows(4, 8192)[:, ::2])  # dtype, stride
    # one-shot up to TWO_SHOT_PAST bytes of rows (16 rows of 8192 or 32 of 4096 at 256 KiB), two-shot past them
    assert 0 < four.two_shot_past < cap * 8192 * 2
    two = AllReduceNorm(0, 2, peers[:2], PER_PEER_BYTES[2], 8, MAX_ROWS.get(2), two_shot_past=TWO_SHOT_PAST.get(2))
    assert two.takes(rows(256, 8192)) and not two.takes(rows(257, 8192))  # bytes only: 4 MiB
    assert two.two_shot_past is None  # two ranks: one-shot moves as few bytes


_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixlm.kernels.allreduce_norm import _allreduce_rmsnorm_kernel as fn

out = []
for quant, world, two_shot in ((False, 2, False), (True, 2, False), (False, 4, True), (True, 4, True)):
    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv",
           "s_ptr": "*fp32", "peers_ptr": "*i64", "state_ptr": "*i64", "n_rows": "i32", "stride_x": "i32",
           "stride_res": "i32", "stride_out": "i32", "n_cols": "i32", "eps": "fp32", "rank": "i32",
           "rows_cap": "i32", "data_off": "i32"}
    const = dict(WORLD=world, QUANT=quant, TWO_SHOT=two_shot, USE_PDL=True, BLOCK=4096)
    sig.update({k: "constexpr" for k in const})
    # what a launch with 4096-wide rows tells the compiler: tensors and these integers divide by 16
    hints = [a for a, t in sig.items() if t.startswith("*")]
    hints += ["stride_x", "stride_res", "stride_out", "n_cols", "rows_cap", "data_off"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    out.append({"release_sys": bool(re.search(r"atom\.global\.sys\.release\.exch", ptx)),
                "acquire_sys": bool(re.search(r"ld\.global\.sys\.acquire|atom\.global\.sys\.acquire", ptx)),
                "vector_peer_loads": "ld.global.cg.v4" in ptx,
                "scalar_b16": bool(re.search(r"(ld|st)\.global[.\w]*\.b16\b", ptx))})
print(json.dumps(out))
"""


def test_compiles_for_hopper_with_system_scope_flags_and_vector_rows():
    """The compiler (not the interpreter) builds the kernel for sm_90, one-shot and two-shot: the flags are a
    release store and an acquire load at system scope (peers over NVLink), and rows move in 16-byte vectors (the
    buffers' addresses come from memory, so without the alignment hint every element moved alone; a hint given
    inside a helper function and returned from it was lost)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert r == {"release_sys": True, "acquire_sys": True, "vector_peer_loads": True, "scalar_b16": False}, r


# --- two real processes over shared memory ------------------------------------------------------------------
# The same kernel in two processes under the interpreter, each rank's buffer a POSIX shared-memory segment that
# both map (what symmetric memory is on GPUs: every rank's buffer addressed from every process). The ranks run
# concurrently, each at its own pace (the slower one sleeps at random before some calls), so a fast rank's
# pushes and flags for its next call land while its peer still reads the current one: the parity and the
# "flag at least this epoch" rules are what keep the answers right. Interpreter atomics are the host's.
_SHM_PER_PEER = 16 * 64 * 2
_SHM_HOGS = 6
# world -> (grid, [(rows, quant, two_shot) of each call]): at two ranks a grid of two programs, so that some calls
# loop over rows; at four, a grid of four (every rank owns a program's rows under two-shot), the schemes mixed
_SHM_PLANS = {
    2: (2, [(1, False, False), (3, True, False), (5, False, False), (2, False, False), (4, True, False),
            (1, True, False), (5, False, False), (3, False, False)]),
    4: (4, [(5, False, True), (6, True, True), (2, False, False), (7, False, True), (4, True, False),
            (3, True, True), (8, False, True), (1, False, False)]),
}  # fmt: skip


def _shm_inputs(call: int, rows: int, n: int, world: int):
    """Every rank's partial rows, the shared residual and weight of one call (any process can rebuild them)."""
    g = torch.Generator().manual_seed(1000 + call)
    parts = [torch.randn(rows, n, generator=g).to(torch.bfloat16) for _ in range(world)]
    residual = torch.randn(rows, n, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)
    return parts, residual, w


def _shm_rank(rank: int, world: int, names: list[str], n: int, out) -> None:
    import random
    import time
    from multiprocessing import shared_memory

    from radixlm.srt.distributed.fused_all_reduce import AllReduceNorm

    kill_on_parent_death()  # a rank left waiting for its peers' flags would spin for the rest of the suite
    try:
        grid, calls = _SHM_PLANS[world]
        segments = [shared_memory.SharedMemory(name=name) for name in names]
        bufs = [torch.frombuffer(s.buf, dtype=torch.uint8) for s in segments]
        peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        fused = AllReduceNorm(rank, world, peers, _SHM_PER_PEER, grid, keep=(segments, bufs))
        rng = random.Random(rank)
        if rank == 1:
            # rank 1 runs several times slower (threads sharing its interpreter lock): the others then finish
            # each call first and push their next one while rank 1 still reads the current one
            import sys
            import threading

            sys.setswitchinterval(1e-4)
            for _ in range(_SHM_HOGS):
                threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
        results = []
        for call, (rows, quant, two_shot) in enumerate(calls):
            if rank == 1 and rng.random() < 0.5:
                time.sleep(rng.random() * 0.3)
            parts, residual, w = _shm_inputs(call, rows, n, world)
            got = fused(parts[rank].clone(), residual.clone(), w, 1e-6, quant=quant, two_shot=two_shot)
            results.append([t.view(torch.uint8).clone() if t.dtype == torch.float8_e4m3fn else t.clone() for t in got])
        # as plain pickled bytes: a tensor through the queue would be shared memory this process frees on exit
        out.put(pickle.dumps((rank, results, fused.state.tolist())))
        del fused, bufs, peers
        for s in segments:
            s.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        out.put(pickle.dumps((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None)))


@pytest.mark.skipif(
    DEV == "cuda", reason="the interpreter's multi-process run; GPUs run tests/gpu/test_allreduce_norm_cuda.py"
)
@pytest.mark.parametrize("world", [2, 4])
def test_processes_over_shared_memory_agree_with_each_other_and_the_reference(world):
    """Two ranks one-shot; four ranks one-shot and two-shot calls in one sequence (each program's rows reduced
    by its owner rank and sent back)."""
    from multiprocessing import shared_memory

    from radixlm.kernels.allreduce_norm import allreduce_rmsnorm_ref, buffer_bytes

    n = 64
    grid, calls = _SHM_PLANS[world]
    size = buffer_bytes(world, _SHM_PER_PEER, grid)
    segments = [shared_memory.SharedMemory(create=True, size=size) for _ in range(world)]
    try:
        for s in segments:
            s.buf[:size] = bytes(size)  # flags start below every epoch
        ctx = torch.multiprocessing.get_context("spawn")
        out = ctx.Queue()
        names = [s.name for s in segments]
        procs = [ctx.Process(target=_shm_rank, args=(r, world, names, n, out)) for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            rank, results, state = pickle.loads(out.get(timeout=300))
            assert state is not None, results
            got[rank] = results
            assert state == [len(calls) + 1, 0]  # one epoch a call, counted in the kernel
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in locals().get("procs", []):
            if p.is_alive():  # a rank that waits forever (a flag that never came) must not outlive the test
                p.kill()
        for s in segments:
            s.close()
            s.unlink()
    for call, (rows, quant, _) in enumerate(calls):
        for r in range(1, world):
            for a, b in zip(got[0][call], got[r][call]):
                assert torch.equal(a, b), f"call {call}: ranks 0 and {r} disagree"  # the same bits on every rank
        parts, residual, w = _shm_inputs(call, rows, n, world)
        want = allreduce_rmsnorm_ref(parts, residual.clone(), w, 1e-6, quant=quant)
        assert rel_err(got[0][call][-1], want[-1]) < 1e-2, f"call {call}: residual stream"  # interpreter truncation
        if not quant:
            assert rel_err(got[0][call][0], want[0]) < 1.5e-2, f"call {call}: normed rows"
        else:
            assert torch.allclose(got[0][call][1], want[1], rtol=3e-2), f"call {call}: scales"
