"""The fused all-reduce + residual add + RMSNorm kernel (kernels/allreduce_norm.py) as rank 0 of a group of two,
in one process: the peer's buffer is a second tensor whose address stands in `peers`, and what the peer would
have pushed (its rows and its flags) is placed in rank 0's buffer before the call. Under TRITON_INTERPRET=1 the
kernel's pushes, flags, wait, sum and epoch count run as on a GPU; the wait cannot hang here because the
peer's flags are set first (a missing flag would hang the test, which the flag assertions below also catch).
Two GPUs run the real thing in tests/gpu/test_tp_cuda.py."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


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
    grid = min(rows, grid_max)
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
        assert _rel(got[-1], want[-1]) < 1e-2
        if quant:
            q, s, _ = got
            wq, ws, _ = want
            assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
            assert torch.allclose(s, ws, rtol=3e-2)  # bf16 truncation in the interpreter
        else:
            out, _ = got
            assert out.data_ptr() == x.data_ptr()  # in place, as fused_add_rmsnorm_
            assert _rel(out, want[0]) < 1.5e-2


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


_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixlm.kernels.allreduce_norm import _allreduce_rmsnorm_kernel as fn

out = []
for quant in (False, True):
    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv",
           "s_ptr": "*fp32", "peers_ptr": "*i64", "state_ptr": "*i64", "n_rows": "i32", "stride_x": "i32",
           "stride_res": "i32", "stride_out": "i32", "n_cols": "i32", "eps": "fp32", "rank": "i32",
           "rows_cap": "i32", "data_off": "i32"}
    const = dict(WORLD=2, QUANT=quant, USE_PDL=True, BLOCK=4096)
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
    """The compiler (not the interpreter) builds the kernel for sm_90: the flags are a release store and an
    acquire load at system scope (peers over NVLink), and rows move in 16-byte vectors (the buffers' addresses
    come from memory, so without the alignment hint every element moved alone)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert r == {"release_sys": True, "acquire_sys": True, "vector_peer_loads": True, "scalar_b16": False}, r
