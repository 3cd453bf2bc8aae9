"""The FP8 tensor-core kernel compiled for Hopper (sm_90) on any machine. Triton's compiler needs no GPU, and it
differs from the interpreter CI runs the kernels under: the interpreter runs Python, the compiler builds every
statement it reaches (after a return under a constexpr `if`, say) and types each one. Code that only the compiler
rejects fails here, in CI, instead of on the first device call. The compile runs in a child process without
TRITON_INTERPRET (the test session sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from radixlm.kernels import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

# (TMA, SILU_MUL, SPLIT_K, BLOCK_M): each way of loading with and without the fused SiLU and split K, and a
# whole-batch tile (four compiles, about 15 s on one core without a Triton cache)
CASES = [(False, True, 1, 64), (False, False, 4, 64), (True, False, 1, 16), (True, True, 2, 128)]

_CHILD = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixlm.kernels.fp8_mm import _fp8_mm_kernel as fn

results = []
for tma, silu, split, bm in json.loads(sys.argv[1]):
    bn, bk = 64, 128
    x = f"tensordesc<fp8e4nv[{bm}, {bk}]>" if tma else "*fp8e4nv"
    w = f"tensordesc<fp8e4nv[{bn}, {bk}]>" if tma else "*fp8e4nv"
    sig = {"x_src": x, "xs_ptr": "*fp32", "w_src": w, "ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_om": "i32", "up_offset": "i32", "k_per_split": "i32"}
    const = dict(HAS_BIAS=False, SILU_MUL=silu, EVEN_K=True, TMA=tma, USE_PDL=True, PRECISE=True, SPLIT_K=split,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    sig.update({k: "constexpr" for k in const})
    # A launch tells the compiler which pointers and integers divide by 16 (tensors' data; a real weight's N, K and
    # strides; not a decode batch's M), and that changes the code (vector widths, whether loads are pipelined
    # through shared memory): give the same hints, so that this is the program a launch would build
    hints = [a for a, t in sig.items() if (t.startswith("*") or t == "i32") and a != "M"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)  # fmt: skip
    try:
        opts = {"num_warps": 4, "num_stages": 3}
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        mmas = [m.start() for m in re.finditer(r"\b(wgmma|mma)\.", ptx)]  # the MMA instructions
        results.append({"ok": True, "mma": bool(mmas), "bulk_tensor": "cp.async.bulk.tensor" in ptx,
                        "pdl": bool(mmas) and 0 <= wait < mmas[0] and mmas[-1] < launch})
    except Exception as e:
        results.append({"ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CASES)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip(CASES, json.loads(proc.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("case", CASES, ids=[f"tma{int(c[0])}-silu{int(c[1])}-split{c[2]}-m{c[3]}" for c in CASES])
def test_fp8_mm_kernel_compiles_for_hopper(compiled, case):
    tma = case[0]
    result = compiled[case]
    assert result["ok"], result.get("error")
    assert result["mma"]  # the tiles reach the tensor cores
    assert result["bulk_tensor"] == tma  # the copy engine fetches them exactly when TMA is asked for
    # The input is waited for before the first MMA reads it, and the next kernel launches after the last MMA
    assert result["pdl"]


_DECODE_CHILD = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from radixlm.kernels.decode_attention import _decode_stage1 as fn

ptrs = {"q_ptr": "*bf16", "qrows_ptr": "*i64", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "r2t_ptr": "*i32",
        "rows_ptr": "*i64", "lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": "*bf16"}
results = []
for staged in json.loads(sys.argv[1]):
    sig = {a: ptrs.get(a, "fp32" if a in ("qk_scale", "o_scale") else "i32") for a in fn.arg_names
           if a in ptrs or a.startswith("stride") or a in ("qk_scale", "o_scale", "num_splits")}
    # the 70B shape's launch on an e4m3 pool: 8 query heads a KV head, 128 keys a tile, one split
    const = dict(GROUP=8, BLOCK_H=16, BLOCK_N=128, D=128, BLOCK_D=128, F32_DOT=False, F16_DOT=True, DOT_PREC="ieee",
                 V_STAGED=staged, HAS_QROWS=False, DIRECT=True)
    sig.update({k: "constexpr" for k in const})
    hints = [a for a, t in sig.items() if t.startswith("*") or a.startswith("stride")]  # as a launch gives them
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in hints}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)  # fmt: skip
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 5})
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x128x128xf8E4M3FN", ttgir)
    results.append({"mma": bool(re.search(r"\bmma\.sync", ptx)), "kv_buffers": [int(b) for b in buffers],
                    "byte_loads": len(re.findall(r"ld\.shared\.[bu]8", ptx)), "shared": k.metadata.shared})
print(json.dumps(results))
"""


def test_e4m3_decode_attention_reads_shared_memory_in_words_on_hopper():
    """The decode attention over an e4m3 pool as compiled for Hopper with its default launch (five stages, V widened
    first): V is read from shared memory in 32-bit words or wider, where the P x V dot's layout change on the e4m3
    tile reads it a byte at a time (the second compile shows the check sees that), and K and V each get two
    shared-memory buffers, so the next tile's copy overlaps this one's dots."""
    from radixlm.kernels.decode_launch import shared_bytes

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _DECODE_CHILD, json.dumps([True, False])], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    staged, inside = json.loads(proc.stdout.strip().splitlines()[-1])
    assert staged["mma"] and inside["mma"]
    assert staged["byte_loads"] == 0
    assert inside["byte_loads"] >= 64  # 128 x 128 bytes over 128 threads
    assert staged["kv_buffers"] == [2, 2]
    # the estimate launch_defaults chooses the stages by (a GPU with less shared memory gets three)
    assert staged["shared"] == shared_bytes(128, 128, 5, fp8=True, v_staged=True)
    assert inside["shared"] == shared_bytes(128, 128, 5, fp8=True, v_staged=False)
