"""The short-extend attention kernel (a verify step's requests of a few new tokens each) against the torch
reference: causal within each request's new tokens, split KV merged, room past the batch ignored, other rows of
out untouched; and the triton backend routing a batch's requests to it by their new-token count."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import HAS_TRITON
from tests.kernels.test_kernels import DEV, _paged_setup, rel_err, tol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")]


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,splits",
    [
        (torch.bfloat16, 8, 2, 32, 1),
        (torch.float32, 8, 2, 32, 3),
        (torch.bfloat16, 14, 2, 16, 5),  # a group of 7: 9 tokens a request, 63 of the tile's 64 rows
        (torch.float32, 4, 4, 16, 2),
    ],
)
def test_short_extend_attention(dtype, heads, kv_heads, head_dim, splits):
    from radixlm.kernels.short_extend_attention import (
        short_extend_attention,
        short_extend_attention_ref,
        short_max_tokens,
    )

    t_max = short_max_tokens(heads // kv_heads)
    extend = [2, t_max, 3, 5][: 4 if t_max >= 5 else 3]
    prefix = [37, 0, 90, 1][: len(extend)]  # a request with no prefix: its first token sees only itself
    lens = [p + e for p, e in zip(prefix, extend)]
    g, k_cache, v_cache, r2t, rows = _paged_setup(dtype, heads, kv_heads, head_dim, lens, sum(lens) + heads)
    # q rows of other kinds between the requests' rows: they must stay as they were
    starts = [1 + sum(extend[:i]) + 2 * i for i in range(len(extend))]
    q = torch.randn(starts[-1] + extend[-1] + 2, heads, head_dim, generator=g).to(DEV, dtype)
    i64 = lambda v: torch.tensor(v + [0], dtype=torch.int64, device=DEV)  # noqa: E731 (room to spare)
    n = len(extend)
    ctl = torch.tensor([n, splits], dtype=torch.int64, device=DEV)
    out = torch.full_like(q, 7.0)
    room = n + 1
    caps = (room * splits, room if splits > 1 else 0, room * splits)
    scale = head_dim**-0.5
    short_extend_attention(
        q, k_cache, v_cache, r2t, i64(rows.tolist()), i64(prefix), i64(extend), i64(starts), ctl, scale, out, caps
    )
    ref = short_extend_attention_ref(
        q, k_cache, v_cache, r2t, rows, i64(prefix)[:n], i64(extend)[:n], i64(starts)[:n], scale
    )
    mine = torch.zeros(len(q), dtype=torch.bool)
    for s0, e in zip(starts, extend):
        mine[s0 : s0 + e] = True
    assert rel_err(out[mine.to(DEV)], ref[mine.to(DEV)]) < tol(dtype)
    assert (out[~mine.to(DEV)] == 7.0).all()


def test_short_extend_matches_the_extend_kernel():
    """The same batch through the extend kernel's block table and through the short kernel: the same answer
    (float32), so a request may take either by its length without changing what it computes."""
    from radixlm.kernels.extend_attention import extend_attention, extend_block_m, extend_blocks
    from radixlm.kernels.short_extend_attention import short_extend_attention

    prefix, extend = [12, 60, 0], [9, 2, 16]
    lens = [p + e for p, e in zip(prefix, extend)]
    g, k_cache, v_cache, r2t, rows = _paged_setup(torch.float32, 8, 2, 32, lens, 5)
    q = torch.randn(sum(extend), 8, 32, generator=g).to(DEV)
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=DEV)  # noqa: E731
    starts = [0, 9, 11]
    reqs, blocks = extend_blocks(extend, extend_block_m(32, q.is_cuda))
    a = extend_attention(q, k_cache, v_cache, r2t, rows, t(prefix), t(extend), t(starts), t([reqs, blocks]), 0.2)
    b = short_extend_attention(
        q, k_cache, v_cache, r2t, rows, t(prefix), t(extend), t(starts), t([3, 2]), 0.2, torch.zeros_like(q), (6, 3, 6)
    )
    assert rel_err(b, a) < 1e-5


def test_short_caps_and_lengths():
    """Room: the stage-1 grid holds the most items any request count up to the room needs; the merge grid and the
    partials' buffer only the counts split more than once. A request takes the kernel while its tokens times the
    group fit the 64-row tile."""
    from radixlm.kernels.decode_launch import decode_num_splits
    from radixlm.kernels.short_extend_attention import short_caps, short_max_tokens

    items, merged, buffered = short_caps(256, 8, 132)
    assert items == max(n * decode_num_splits(n, 8, 132) for n in range(1, 257))
    assert merged == max(n for n in range(1, 257) if decode_num_splits(n, 8, 132) > 1)
    assert buffered == max(n * decode_num_splits(n, 8, 132) for n in range(1, merged + 1))
    assert buffered < items  # many requests: one split each, no partials
    s4 = decode_num_splits(4, 8, 132)
    assert short_caps(4, 8, 132, least=4) == (4 * s4, 4, 4 * s4)  # one batch's own launch: exactly its count
    assert short_caps(64, 8, 132, least=64) == (64, 0, 0)  # unsplit: no merge, no partials
    assert (short_max_tokens(4), short_max_tokens(8), short_max_tokens(7), short_max_tokens(64)) == (16, 8, 9, 0)


def test_backend_routes_requests_by_length():
    """One-token rows go to the decode rows kernel, requests of 2..short_max tokens to the short kernel, longer
    ones to the extend kernel's blocks; a graph's layout has room for as many short requests as half its
    tokens (at most the running requests), and a verify batch of 64 requests fits a whole graph's bucket."""
    from radixlm.srt.layers.attention.triton_backend import TritonAttnBackend

    be = TritonAttnBackend(8, torch.device("cpu"), 128, group=4)
    assert [be._kind(n) for n in (1, 2, 16, 17, 300)] == [0, 1, 1, 2, 2]
    layout = be.extend_graph_layout(640, 256)
    assert layout.shorts == 256 and layout.multis == 32
    assert be.fits_extend(layout, [9] * 64)
    assert be.fits_extend(layout, [1] * 40 + [5] * 100 + [200])
    assert not be.fits_extend(be.extend_graph_layout(64, 256), [2] * 33)  # 32 shorts of room in 64 tokens
    assert TritonAttnBackend(8, torch.device("cpu"), 128, group=64).extend_graph_layout(640, 256).shorts == 0
