"""Our C kernels for CPU decode (kernels/cpu_kernels.c) against their torch references (kernels/cpu.py)."""

import pytest
import torch

from radixlm.kernels import cpu
from tests.helpers import rel_err


@pytest.fixture(scope="module", autouse=True, params=["native", "portable", "no-avx2"])
def built(request):
    """Every test against the library as shipped (-march=native), against a build without AVX-512 (the AVX2
    code paths, where this CPU has AVX2) and against one without AVX2 either (the plain C ones)."""
    assert cpu.load() is not None  # CI has gcc: without it the torch paths run and these kernels never do
    if request.param == "native":
        yield request.param
        return
    lib = cpu.build_variant(("-mno-avx512f",) if request.param == "portable" else ("-mno-avx2",))
    assert lib.q8_gemm_avx512() == 0
    if request.param == "no-avx2":
        assert lib.q4_gemm_available() == 0 and lib.q4_gemm_isa() == 0
    mp = pytest.MonkeyPatch()
    mp.setattr(cpu, "load", lambda: lib)
    yield request.param
    mp.undo()


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and flag in line.split() for line in f)


def _bf16_ulps(ref: torch.Tensor, x: torch.Tensor) -> int:
    """Largest distance in bf16 steps (same-sign finite values)."""
    a, b = ref.view(torch.int16).int(), x.view(torch.int16).int()
    return (a - b).abs().max().item()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 17, 40])  # every AVX2 pass size (1-8 rows)
def test_q8_gemm_matches_fp64(m):
    g = torch.Generator().manual_seed(m)
    n, k = 1000, 96  # n not a multiple of the kernel's 64-row chunks
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = torch.rand(n, k // 32, generator=g).half().float() / 50  # fp16 scales, as in the file
    x = torch.randn(m, k + 5, generator=g)[:, 2 : k + 2]  # a row stride other than k
    ref = x.double() @ (q.view(n, -1, 32).double() * d.double().unsqueeze(-1)).view(n, k).T
    y = cpu.q8_gemm(q, d, x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel_err(y, ref) < 1e-6  # fp32 sums of exact products
    assert rel_err(y, cpu.q8_gemm_ref(q, d, x)) < 1e-6


@pytest.mark.parametrize("add_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_add_rmsnorm(add_dtype, out_dtype):
    g = torch.Generator().manual_seed(1)
    t, h = 5, 200  # h not a multiple of the 16 lanes
    res = torch.randn(t, h, generator=g) * 4
    add = None if add_dtype is None else torch.randn(t, h, generator=g).to(add_dtype)
    w = torch.rand(h, generator=g) + 0.5
    ref_res = res.clone()
    ref = cpu.add_rmsnorm_ref(ref_res, add, w, 1e-5, out_dtype)
    out = cpu.add_rmsnorm(res, add, w, 1e-5, out_dtype)
    assert torch.equal(res, ref_res)  # the residual sum is exact either way
    assert out.dtype == out_dtype
    if out_dtype == torch.bfloat16:
        assert _bf16_ulps(ref, out) <= 1  # fp32 sums in another order may round the other way
    else:
        assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_store(dtype):
    g = torch.Generator().manual_seed(2)
    t, h, kvh, d = 4, 6, 2, 32
    qkv = torch.randn(t, (h + 2 * kvh) * d + 7, generator=g)[:, : (h + 2 * kvh) * d].to(dtype)  # strided rows
    positions = torch.tensor([0, 5, 17, 3])
    freqs = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    loc = torch.tensor([3, 9, 1, 12])
    caches = [torch.zeros(16, kvh, d) for _ in range(4)]
    q = cpu.rope_store(qkv, positions, cos_sin, caches[0], caches[1], loc, h, kvh, d)
    q_ref = cpu.rope_store_ref(qkv, positions, cos_sin, caches[2], caches[3], loc, h, kvh, d)
    assert (q - q_ref).abs().max().item() < 1e-5
    assert (caches[0] - caches[2]).abs().max().item() < 1e-5
    assert torch.equal(caches[1], caches[3])  # v is copied
    assert caches[0][0].abs().sum() == 0  # only the slots in `loc` are written


def test_decode_attention_ragged():
    g = torch.Generator().manual_seed(3)
    h, kvh, d, slots = 9, 3, 64, 300
    k_cache, v_cache = torch.randn(slots, kvh, d, generator=g), torch.randn(slots, kvh, d, generator=g)
    req_to_token = torch.zeros(8, 128, dtype=torch.int32)
    lens = [65, 1, 120, 17]
    perm = torch.randperm(slots - 1, generator=g) + 1
    rows = torch.tensor([5, 0, 2, 7])
    start = 0
    for row, n in zip(rows.tolist(), lens):
        req_to_token[row, :n] = perm[start : start + n].int()
        start += n
    seq_lens = torch.tensor(lens)
    q = torch.randn(4, h, d, generator=g) * 2
    out = cpu.decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, max(lens), d**-0.5)
    ref = cpu.decode_attention_ref(q, k_cache, v_cache, req_to_token, rows, seq_lens, max(lens), d**-0.5)
    assert out.shape == (4, h * d)
    assert (out - ref).abs().max().item() < 1e-5


def test_silu_mul_bf16():
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(3, 2 * 1536, generator=g) * 6).to(torch.bfloat16)
    gu[0, :8] = torch.tensor([-100.0, -90.0, -30.0, 0.0, 30.0, 90.0, 1e-30, -1e-30])  # clamps, tiny values
    out, ref = cpu.silu_mul_bf16(gu), cpu.silu_mul_bf16_ref(gu)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 1536)
    # exp is clamped at 88: silu(-100) comes out ~1e-36 where torch gives 0; elsewhere within a bf16 step
    normal = ref.float().abs() > 1e-30
    assert _bf16_ulps(ref[normal], out[normal]) <= 1
    assert (out.float() - ref.float())[~normal].abs().max().item() < 1e-30


def _q4_isa_expected(built: str) -> str | None:
    """The Q4 kernel a build should hold on this CPU: AVX-512 BF16 where the build may use AVX-512 and the CPU
    has it, else AVX2 (+ FMA, F16C) where the build may use AVX2 and the CPU has it, else none."""
    if built == "native" and _cpu_has("avx512_bf16") and _cpu_has("avx512bw"):
        return "AVX-512 BF16"
    if built != "no-avx2" and all(_cpu_has(f) for f in ("avx2", "fma", "f16c")):
        return "AVX2"
    return None


def test_q4_kernel_is_the_one_this_cpu_and_build_allow(built):
    """q4_available / q4_isa / describe name the kernel compiled in; a build that may not use AVX2 has none
    (the loader then keeps torch's int4 op, and auto dequantizes)."""
    want = _q4_isa_expected(built)
    assert cpu.q4_isa() == want
    assert cpu.q4_available() == (want is not None)
    desc = cpu.describe()
    if want is not None:
        assert want in desc, desc
    else:
        assert "AVX2" not in desc and "BF16" not in desc, desc


def _q4_case(rng, n: int, k: int, style: str):
    """Nibbles and fp16-exact scales: Q4_1 (d and an independent min m, as SmolLM2's file) or Q4_0 (m = -8 d)."""
    import numpy as np

    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // 32)) / 50).astype(np.float16).astype(np.float32)
    if style == "q4_0":
        mins = -8 * d
    else:
        mins = (-rng.random((n, k // 32)) / 10).astype(np.float16).astype(np.float32)
    return q, d, mins


@pytest.mark.parametrize("style", ["q4_1", "q4_0"])
@pytest.mark.parametrize("m", list(range(1, 18)) + [40])
def test_q4_gemm_matches_fp64(m, style, built):
    """Against fp64 over the dequantized weight with x rounded to bf16 (as the kernel takes it). Every M from 1
    to 17 and 40: each of the AVX2 kernel's pass sizes (1-4 rows) and splits of M into passes, and the AVX-512
    one's 8-row passes with every remainder. A build without a Q4 kernel must say so (the loader then uses
    torch's op)."""
    import numpy as np

    if _q4_isa_expected(built) is None:
        assert not cpu.q4_available()
        return
    rng = np.random.default_rng(m)
    n, k = 48, 96  # three 16-row tiles, three blocks
    q, d, mins = _q4_case(rng, n, k, style)
    qs, dm = cpu.q4_pack(q, d, mins)
    x = torch.randn(m, k + 3, generator=torch.Generator().manual_seed(m))[:, 1 : k + 1]  # row stride other than k
    y = cpu.q4_gemm(qs, dm, x, n, k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = cpu.q4_gemm_ref(q, d, mins, x)
    assert rel_err(y, ref) < 1e-6
    # per output, not only in norm: each one within a few fp32 roundings of its own sums' size
    scale = (
        x.bfloat16().double().abs()
        @ torch.from_numpy(
            (np.abs(d)[..., None] * 15 + np.abs(mins)[..., None]).astype(np.float64).repeat(32, -1).reshape(n, k)
        ).T
    )
    assert ((y.double() - ref).abs() <= 1e-6 * scale).all()


@pytest.mark.parametrize("m", [1, 3, 16])
def test_q4_gemm_long_rows_and_wide_tiles(m, built):
    """SmolLM2's down_proj shape (K = 1536: 48 blocks summed per output) and more tiles than threads; x's
    values spread over several binades, so the bf16 rounding of x matters."""
    import numpy as np

    if _q4_isa_expected(built) is None:
        return  # covered by test_q4_gemm_matches_fp64
    rng = np.random.default_rng(100 + m)
    n, k = 576, 1536
    q, d, mins = _q4_case(rng, n, k, "q4_1")
    qs, dm = cpu.q4_pack(q, d, mins)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(2 * m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (2 * m, k), generator=g)))[::2]
    y = cpu.q4_gemm(qs, dm, x, n, k)
    assert rel_err(y, cpu.q4_gemm_ref(q, d, mins, x)) < 1e-6
    # x is rounded to bf16 inside: an x that is not bf16 gives the product of its rounded values
    assert torch.equal(y, cpu.q4_gemm(qs, dm, x.bfloat16().float(), n, k))
