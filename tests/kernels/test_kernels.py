"""Every Triton kernel against its torch reference on small ragged shapes. Without a GPU they run under
TRITON_INTERPRET=1 (set in tests/conftest.py); on CUDA the same tests run the compiled kernels."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import HAS_TRITON

# Also in the GPU suite (`-m gpu`): on CUDA these run the real kernels and capture real graphs.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1.5e-2


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (7, 96), (3, 576)])
def test_rmsnorm(dtype, rows, n):
    from radixlm.kernels.norm import fused_add_rmsnorm_, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref

    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(DEV, dtype)
    r = torch.randn(rows, n, generator=g).to(DEV, dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV, dtype)
    assert rel_err(rmsnorm(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6)) < tol(dtype)
    ref_out, ref_res = fused_add_rmsnorm_ref(x, r, w, 1e-6)
    out, res = fused_add_rmsnorm_(x.clone(), r.clone(), w, 1e-6)
    assert rel_err(res, ref_res) < tol(dtype)  # the interpreter rounds bf16 by truncation
    assert rel_err(out, ref_out) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 1500)])
def test_silu_and_mul(dtype, rows, n):
    from radixlm.kernels.activation import silu_and_mul, silu_and_mul_ref

    x = (2 * torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(n))).to(DEV, dtype)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 32, False), (6, 2, 64, True), (3, 3, 16, False)])
def test_rope_and_store(dtype, heads, kv_heads, head_dim, qk_norm):
    from radixlm.kernels.rope import rope_and_store, rope_and_store_ref
    from radixlm.srt.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(heads * head_dim)
    t, slots = 9, 40
    rot = RotaryEmbedding(
        head_dim,
        256,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    cos_sin = rot.cos_sin.to(DEV)
    # q, k, v as strided views of one fused projection, as the model produces them.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEV, dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)
    positions = torch.randint(0, 256, (t,), generator=g).to(DEV)
    loc = torch.randperm(slots, generator=g)[:t].to(DEV)
    norms = {}
    if qk_norm:
        norms = {
            "q_norm_weight": (1 + 0.1 * torch.randn(head_dim, generator=g)).to(DEV, dtype),
            "k_norm_weight": (1 + 0.1 * torch.randn(head_dim, generator=g)).to(DEV, dtype),
        }
    caches = [poison(torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=DEV)) for _ in range(4)]
    q_ref = rope_and_store_ref(positions, q, k, v, cos_sin, caches[0], caches[1], loc, **norms)
    q_out = rope_and_store(positions, q, k, v, cos_sin, caches[2], caches[3], loc, **norms)
    assert rel_err(q_out, q_ref) < tol(dtype)
    assert rel_err(caches[2][loc], caches[0][loc]) < tol(dtype)
    assert torch.equal(caches[3][loc], caches[1][loc])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert caches[2][untouched.to(DEV)].isnan().all()  # nothing written outside `loc`


def _paged_setup(dtype, heads, kv_heads, head_dim, lens, seed):
    """A pool with random K/V and a req_to_token table whose rows point at scattered slots."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens) + 5
    k_cache = torch.randn(total + 1, kv_heads, head_dim, generator=g).to(DEV, dtype)
    v_cache = torch.randn(total + 1, kv_heads, head_dim, generator=g).to(DEV, dtype)
    perm = torch.randperm(total, generator=g) + 1
    rows = torch.tensor([2 * i + 1 for i in range(len(lens))])  # rows in use are not 0..B-1
    r2t = torch.zeros(2 * len(lens) + 2, max(lens) + 3, dtype=torch.int32)
    pos = 0
    for i, n in enumerate(lens):
        r2t[rows[i], :n] = perm[pos : pos + n].to(torch.int32)
        pos += n
    return g, k_cache, v_cache, r2t.to(DEV), rows.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 64), (6, 1, 16)])
@pytest.mark.parametrize("lens,splits", [([37], 1), ([37], 4), ([1, 70, 5, 129, 16, 2, 33], 3), ([200], 16)])
def test_decode_attention(dtype, heads, kv_heads, head_dim, lens, splits):
    from radixlm.kernels.decode_attention import decode_attention, decode_attention_ref

    g, k_cache, v_cache, r2t, rows = _paged_setup(dtype, heads, kv_heads, head_dim, lens, sum(lens) + heads)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(DEV, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    out = poison(torch.empty_like(q))
    decode_attention(q, k_cache, v_cache, r2t, rows, seq_lens, scale, num_splits=splits, out=out, block_n=16)
    ref = decode_attention_ref(q, k_cache, v_cache, r2t, rows, seq_lens, scale)
    assert rel_err(out, ref) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_rows_in_place(dtype):
    """With q_rows, each request reads its query row of a larger q and writes the same row of out; the other
    rows of out are left as they were."""
    from radixlm.kernels.decode_attention import decode_attention, decode_attention_ref

    lens = [9, 70, 1]
    g, k_cache, v_cache, r2t, rows = _paged_setup(dtype, 8, 2, 32, lens, sum(lens) + 8)
    q = torch.randn(6, 8, 32, generator=g).to(DEV, dtype)
    q_rows = torch.tensor([4, 0, 2], dtype=torch.int64, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, 7.0)
    decode_attention(
        q, k_cache, v_cache, r2t, rows, seq_lens, 32**-0.5, num_splits=3, out=out, block_n=16, q_rows=q_rows
    )
    ref = decode_attention_ref(q[q_rows], k_cache, v_cache, r2t, rows, seq_lens, 32**-0.5)
    assert rel_err(out[q_rows], ref) < tol(dtype)
    untouched = [i for i in range(6) if i not in q_rows.tolist()]
    assert (out[untouched] == 7.0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_attention_rows(dtype, splits):
    """The fixed-launch form for the one-token rows of a mixed batch: the row count and split count come from
    the device (`ctl`), room past the count is ignored, and each row's result is bit for bit what the
    per-batch launch with the same split count gives; rows of out that are not its rows stay as they were."""
    from radixlm.kernels.decode_attention import decode_attention, decode_attention_ref
    from radixlm.kernels.decode_attention_rows import decode_attention_rows

    lens = [9, 70, 1, 33]
    g, k_cache, v_cache, r2t, rows = _paged_setup(dtype, 8, 2, 32, lens, sum(lens) + 8)
    q = torch.randn(7, 8, 32, generator=g).to(DEV, dtype)
    q_rows = torch.tensor([4, 0, 2, 6], dtype=torch.int64, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    pad = lambda t: torch.cat([t, torch.zeros(3, dtype=t.dtype, device=DEV)])  # noqa: E731 (room to spare)
    ctl = torch.tensor([len(lens), splits], dtype=torch.int64, device=DEV)
    out = torch.full_like(q, 7.0)
    decode_attention_rows(
        q,
        k_cache,
        v_cache,
        r2t,
        pad(q_rows),
        pad(rows),
        pad(seq_lens),
        ctl,
        32**-0.5,
        out,
        max_items=7 * splits,
        block_n=16,
    )
    ref = decode_attention_ref(q[q_rows], k_cache, v_cache, r2t, rows, seq_lens, 32**-0.5)
    assert rel_err(out[q_rows], ref) < tol(dtype)
    assert (out[[1, 3, 5]] == 7.0).all()
    per_batch = torch.full_like(q, 7.0)
    decode_attention(
        q, k_cache, v_cache, r2t, rows, seq_lens, 32**-0.5, num_splits=splits, out=per_batch, block_n=16, q_rows=q_rows
    )
    assert torch.equal(out, per_batch)


def test_decode_launch_stages_fit_the_gpus_shared_memory():
    """An e4m3 pool's default launch takes five stages where a program may have the shared memory they need
    (Hopper: 227 KB), three where it may not (sm_89: 99 KB), and five where nothing is known (the interpreter)."""
    from radixlm.kernels.decode_launch import launch_defaults, shared_bytes

    e4m3 = torch.float8_e4m3fn
    assert shared_bytes(128, 128, 5, True, True) == 107_520 and shared_bytes(128, 128, 3, True, True) == 74_240
    assert launch_defaults(e4m3, 1, None, None, 128, 227 * 1024) == (128, 5)
    assert launch_defaults(e4m3, 1, None, None, 128, 99 * 1024) == (128, 3)
    assert launch_defaults(e4m3, 1, None, None, 128, None) == (128, 5)
    assert launch_defaults(e4m3, 1, None, None, 256, 227 * 1024) == (128, 5)  # 205 KB
    assert launch_defaults(e4m3, 1, 64, 4, 128, 99 * 1024) == (64, 4)  # what the caller asks for stays
    assert launch_defaults(torch.bfloat16, 1, None, None, 128, 227 * 1024) == (64, 2)


def test_decode_split_counts():
    """Splits fill about two waves of programs; an e4m3 pool's launch takes as many as one wave of two programs an
    SM holds (unsplit from one full wave on, where stage 1 writes the output), and the rows kernel's buffer holds
    the most items any row count needs under either rule."""
    from radixlm.kernels.decode_attention_rows import rows_items_cap
    from radixlm.kernels.decode_launch import MAX_SPLITS, decode_num_splits

    e4m3 = torch.float8_e4m3fn
    assert decode_num_splits(1, 8, 132) == MAX_SPLITS == decode_num_splits(1, 8, 132, e4m3)
    assert decode_num_splits(32, 8, 132) == 2  # 256 programs: two waves of 132 want two splits
    assert decode_num_splits(32, 8, 132, e4m3) == 1
    assert decode_num_splits(16, 8, 132) == 3
    assert decode_num_splits(16, 8, 132, e4m3) == 2  # 256 programs: one wave at two an SM
    assert decode_num_splits(17, 8, 132, e4m3) == 1
    for dtype in (None, e4m3):
        cap = rows_items_cap(64, 8, 132, dtype)
        assert cap == max(n * decode_num_splits(n, 8, 132, dtype) for n in range(1, 65))
    assert rows_items_cap(64, 8, 132, e4m3) == 64  # at most 2 x 132 / 8 items below 17 rows, n from 17 on


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 64)])
@pytest.mark.parametrize(
    "prefix,extend", [([0], [23]), ([17], [5]), ([0, 40, 3, 0, 9, 64, 1], [7, 1, 30, 18, 2, 5, 33])]
)
def test_extend_attention(dtype, heads, kv_heads, head_dim, prefix, extend):
    from radixlm.kernels.extend_attention import extend_attention, extend_attention_ref, extend_block_m, extend_blocks

    lens = [p + e for p, e in zip(prefix, extend)]
    g, k_cache, v_cache, r2t, rows = _paged_setup(dtype, heads, kv_heads, head_dim, lens, sum(lens) + head_dim)
    q = torch.randn(sum(extend), heads, head_dim, generator=g).to(DEV, dtype)
    p_t = torch.tensor(prefix, dtype=torch.int32, device=DEV)
    e_t = torch.tensor(extend, dtype=torch.int32, device=DEV)
    starts = torch.cumsum(e_t, 0, dtype=torch.int32) - e_t
    scale = head_dim**-0.5
    out = poison(torch.empty_like(q))
    reqs, blocks = extend_blocks(extend, extend_block_m(head_dim, q.is_cuda))
    # The table in a random order, with unused (-1) entries mixed in, as a fixed-size CUDA graph table has them.
    order = torch.randperm(len(reqs) + 3, generator=g).tolist()
    table = torch.tensor(
        [(reqs + [-1] * 3)[i] for i in order] + [(blocks + [0] * 3)[i] for i in order], dtype=torch.int64
    ).view(2, -1)
    extend_attention(q, k_cache, v_cache, r2t, rows, p_t, e_t, starts, table.to(DEV), scale, out=out)
    ref = extend_attention_ref(q, k_cache, v_cache, r2t, rows, p_t, e_t, scale)
    assert rel_err(out, ref) < tol(dtype)


def test_kv_indices():
    from radixlm.kernels.kv_indices import build_kv_indices, build_kv_indices_ref

    lens = [3, 1, 700, 0, 12]
    g, _, _, r2t, rows = _paged_setup(torch.float32, 2, 1, 16, [max(n, 1) for n in lens], 5)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV)
    indptr[1:] = torch.cumsum(seq, 0)
    out = torch.full((sum(lens) + 4,), -1, dtype=torch.int32, device=DEV)
    ref = out.clone()
    build_kv_indices(r2t, rows, seq, indptr, out)
    build_kv_indices_ref(r2t, rows, seq, indptr, ref)
    assert torch.equal(out, ref)
    assert (out[sum(lens) :] == -1).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 37, 300, False), (3, 64, 256, True), (8, 20, 96, False)])
def test_gemv(dtype, m, n, k, bias):
    from radixlm.kernels.gemv import CONFIGS, _block_m, gemv, gemv_ref, gemv_silu_mul, gemv_silu_mul_ref

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5).to(DEV, dtype)
    b = torch.randn(2 * n, generator=g).to(DEV, dtype) if bias else None
    for cfg in CONFIGS[_block_m(m)][:2]:  # the loop's masked tail (k % BLOCK_K) and the even path both run
        assert rel_err(gemv(x, w, b, cfg), gemv_ref(x, w, b)) < tol(dtype)
        # Three roundings to the activation dtype (gate, up, silu) on each side: half again the tolerance.
        assert rel_err(gemv_silu_mul(x, w, b, cfg), gemv_silu_mul_ref(x, w, b)) < 1.5 * tol(dtype)


@pytest.mark.parametrize("rows,n", [(1, 5000), (7, 4096), (3, 9000)])
def test_argmax(rows, n):
    from radixlm.kernels.argmax import argmax, argmax_ref

    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, n, generator=g).to(DEV)
    x[0, 17] = x[0, n - 3] = x[0].max() + 1  # a tie: the lower index wins
    if rows > 1:
        x[1] = float("-inf")  # a fully masked row (a grammar with nothing allowed) picks column 0
        x[1, n - 1] = -1e30
    if rows > 2:
        x[2, 4100:] = x[2].max() + 2  # the maximum is in a later chunk, tied across the chunk boundary
    assert argmax(x).tolist() == argmax_ref(x).tolist()
    assert argmax(x.to(torch.bfloat16)).tolist() == argmax_ref(x.to(torch.bfloat16)).tolist()


@pytest.mark.parametrize("ids,n", [(1, 5), (7, 35), (1500, 6100)])
def test_pull_inputs(ids, n):
    """A graph's input kernel: ring slots in turn (the counter advanced once per launch, also when several
    programs share it), futures among the ids swapped for their tokens, everything else copied as is."""
    from radixlm.kernels.graph_inputs import pull_inputs, pull_inputs_ref

    g = torch.Generator().manual_seed(n)
    ring = torch.randint(0, 1000, (3, n), generator=g, dtype=torch.int64)
    ring[1, 0] = -1  # a future: future_map[0]
    ring[2, ids - 1] = -5  # future_map[4]
    ring[2, ids] = -3  # past the ids: a plain value, not a future
    if DEV == "cuda":
        ring = ring.pin_memory()
    future_map = torch.tensor([11, 12, 13, 14, 15, 16], dtype=torch.int64, device=DEV)
    counter, counter_ref = (torch.zeros(2, dtype=torch.int64, device=DEV) for _ in range(2))
    static, static_ref = (torch.full((n,), -7, dtype=torch.int64, device=DEV) for _ in range(2))
    for turn in range(4):  # the fourth replay wraps around to slot 0
        pull_inputs(ring, counter, static, future_map, ids)
        pull_inputs_ref(ring, counter_ref, static_ref, future_map, ids)
        assert static.tolist() == static_ref.tolist() and int(counter[0]) == turn + 1
        want = ring[turn % 3].clone()
        assert static[ids:].tolist() == want[ids:].tolist()
        if turn % 3 == 1:
            assert static[0].item() == 11
        if turn % 3 == 2:
            assert static[ids - 1].item() == 15 and static[ids].item() == -3
    assert static[:ids].tolist() == ring[0, :ids].tolist()  # slot 0 (turn 3) has no futures


@pytest.mark.parametrize("m,k", [(1, 96), (5, 4096), (3, 5000), (2, 28672), (2, 40000)])
def test_fp8_quantize_tokens_kernel(m, k):
    """One kernel per row: the same scales and e4m3 values as the torch reference (rows of very different size,
    a K that is not a power of two, a 70B MLP row read in one pass, one longer row read in tiles twice)."""
    from radixlm.kernels.fp8_quant import quantize_tokens, quantize_tokens_ref

    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(DEV, torch.bfloat16)
    q, s = quantize_tokens(x)
    qr, sr = quantize_tokens_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, 1)
    assert torch.allclose(s, sr, rtol=1e-6)
    # The values only on CUDA: Triton 3.7's interpreter casts float32 to e4m3 wrongly where rounding carries into
    # the exponent (-127.27 becomes -64, not -128), so on CPU this checks the scales (and the shapes) alone.
    if DEV == "cuda":
        assert torch.equal(q.float(), qr.float())


@pytest.mark.parametrize("rows,n", [(1, 96), (4, 5000), (2, 20000)])
def test_silu_and_mul_fp8_is_the_activation_then_the_token_quantization(rows, n):
    """SiLU-and-mul writing e4m3 rows for the down projection gives exactly the activation kernel followed by the
    quantization kernel (a row held in registers, a 5000-wide one not a power of two, a 20000-wide one computed
    twice); the torch reference agrees to e4m3 rounding."""
    from radixlm.kernels.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref
    from radixlm.kernels.fp8_quant import quantize_tokens

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(rows, 2 * n, generator=g) * torch.logspace(-1, 1, rows)[:, None]).to(DEV, torch.bfloat16)
    want_q, want_s = quantize_tokens(silu_and_mul(x))
    q, s = silu_and_mul_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, n) and s.shape == (rows, 1)
    assert torch.equal(s, want_s) and torch.equal(q.float(), want_q.float())
    rq, rs = silu_and_mul_fp8_ref(x)
    assert torch.allclose(s, rs, rtol=2e-2)
    if DEV == "cuda":
        assert rel_err(q.float() * s, rq.float() * rs) < 3e-2


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,n", [(1, 96), (5, 576)])
def test_rmsnorm_fp8_is_the_norm_then_the_token_quantization(with_residual, rows, n):
    """The norm writing e4m3 rows for an FP8 projection gives exactly what the norm kernel followed by the
    quantization kernel gives (so fusing them changes no answer), and leaves the residual stream as the fused
    add-norm does (x + residual in place; x itself without one)."""
    from radixlm.kernels.fp8_quant import quantize_tokens
    from radixlm.kernels.norm import fused_add_rmsnorm_, rmsnorm, rmsnorm_fp8, rmsnorm_fp8_ref

    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(DEV, torch.bfloat16)
    r = torch.randn(rows, n, generator=g).to(DEV, torch.bfloat16) if with_residual else None
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEV, torch.bfloat16)
    if r is None:
        normed, want_res = rmsnorm(x, w, 1e-6), x
    else:
        normed, want_res = fused_add_rmsnorm_(x.clone(), r.clone(), w, 1e-6)
    want_q, want_s = quantize_tokens(normed)
    x_before = x.clone()
    q, s, res = rmsnorm_fp8(x, r.clone() if r is not None else None, w, 1e-6)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, n) and s.shape == (rows, 1)
    assert torch.equal(s, want_s) and torch.equal(q.float(), want_q.float())
    assert torch.equal(res, want_res) and torch.equal(x, x_before)  # x is read, never written
    # and the torch reference agrees to bf16 rounding (the interpreter truncates; its e4m3 values on CUDA only)
    rq, rs, rres = rmsnorm_fp8_ref(x, r, w, 1e-6)
    assert torch.allclose(s, rs, rtol=1e-2) and rel_err(rres, want_res) < tol(torch.bfloat16)
    if DEV == "cuda":
        assert rel_err(q.float() * s, rq.float() * rs) < 1e-2


@pytest.mark.parametrize(
    "m,n,k,fused,prequant,split,loads,block_m",
    [
        (1, 64, 256, False, False, 1, 0, None),
        (3, 128, 384, True, False, 2, 0, None),
        (20, 64, 256, False, False, 1, 0, None),
        (2, 96, 256, False, True, 1, 0, None),
        (5, 192, 640, False, True, 3, 0, None),
        (40, 256, 512, True, False, 2, 0, None),  # a 128-row weight tile (block_n below) over 64 padded batch rows
        # tiles fetched by TMA descriptors: rows and K past the matrix come back as zeros, not from a mask
        (3, 96, 400, False, False, 1, 1, None),
        (40, 192, 640, True, True, 3, 1, None),
        (20, 128, 512, True, False, 2, 1, None),
        # the whole batch in one program column (BLOCK_M 128 / 256): 65-256 rows, weights read once
        (100, 128, 384, False, True, 1, 0, 128),
        (70, 192, 512, True, False, 2, 1, 128),
        (200, 64, 256, True, True, 1, 0, 256),
    ],
)
def test_fp8_mm_tensor_core_kernel(m, n, k, fused, prequant, split, loads, block_m):
    """W8A8 on the tensor cores: the product of x quantized per token (here, or beforehand) and the e4m3 rows
    times their scales, as the scaled GEMM computes it; K not a multiple of the tile, N not of the MMA height,
    K split across programs (the last to arrive sums the parts; run twice: it must leave its counters at 0); the
    tiles loaded through pointers and masks, or by TMA descriptors (loads 1); batch rows per program from the
    bucket (at most 64) or the whole bucket (block_m)."""
    from radixlm.kernels import fp8_mm as F
    from radixlm.kernels.fp8_mm import counters_at_rest, fp8_mm
    from radixlm.kernels.fp8_quant import quantize_tokens

    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    amax = w.abs().amax(dim=1)
    scale = (amax / 448.0).to(DEV)
    wq = (w / (amax / 448.0)[:, None]).to(torch.float8_e4m3fn).to(DEV)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(DEV, torch.bfloat16)
    # The reference quantizes x with the Triton kernel too: under the interpreter both share its e4m3 cast
    # (see test_fp8_quantize_tokens_kernel), on CUDA that kernel equals the torch reference.
    xq, xs = quantize_tokens(x)
    want = (xq.float() * xs) @ (wq.float() * scale[:, None]).T
    if fused:
        gate, up = want.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
    cfg = (128 if m > 32 else 64, 128, 4, 2, split, loads) + ((block_m,) if block_m else ())
    for _ in range(2):
        if prequant:
            got = fp8_mm(xq, wq, scale, config=cfg, x_scale=xs, silu_mul=fused)
        else:
            got = fp8_mm(x, wq, scale, config=cfg, silu_mul=fused)
        assert got.shape == (m, n // 2 if fused else n) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1.5e-2
        assert counters_at_rest(got.device)  # every split tile's last program set its counter back to 0
    if split > 1:  # a counter left set is seen (what the tuner checks after each candidate) and cleared
        next(iter(F._COUNTERS.values()))[7] = 1
        assert not counters_at_rest(got.device) and counters_at_rest(got.device)
