"""Whole-forward graphs for extend and mixed batches (the graph runner's `whole` kind, Triton backend): the metadata
in a fixed layout with room to spare gives the logits the eager forward gives, futures are resolved inside, batches
that do not fit fall back, and generation matches eager. On CPU the static path runs as plain calls with the
kernels in Triton's interpreter; on CUDA it is captured."""

import pytest
import torch

import radixlm
from radixlm.kernels import HAS_TRITON
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode
from radixlm.srt.model_executor.graph_runner import GraphRunner
from radixlm.srt.model_executor.synthetic import decode_spec, mixed_spec, release
from tests.helpers import assert_runner_matches_eager, generate_through_runner

# Also in the GPU suite (`-m gpu`): on CUDA these run the real kernels and capture real graphs.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(path, **kw):
    from radixlm.srt.layers.ops import triton_ops

    engine = radixlm.Engine(
        str(path),
        log_level="warning",
        max_total_tokens=4096,
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        disable_cuda_graph=True,
        max_running_requests=8,
        **kw,
    )
    engine.runner.model.set_kernel_ops(triton_ops())
    assert engine.runner.model.model.cpu_path is None
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_whole_extend_graph_matches_eager(tiny_dirs, arch):
    r = _engine(tiny_dirs[arch]).runner
    x = GraphRunner(r, None, "whole", 48).whole

    def whole(spec):
        assert x.fits(spec)
        return x.run(spec)

    assert_runner_matches_eager(r, whole)


def test_whole_extend_graph_resolves_futures_and_falls_back(tiny_dirs):
    engine = _engine(tiny_dirs["llama"])
    r = engine.runner
    x = GraphRunner(r, None, "whole", 32).whole
    spec, slots, rows = mixed_spec(r, 2, 6, 9)
    plain = x.run(spec)
    # The two decode rows' ids as futures: slots j of the future map hold the tokens.
    base = r.store_futures(torch.tensor(spec.input_ids[:2], device=r.device))
    fut = BatchSpec(**{**spec.__dict__, "input_ids": [-(base + 1), -(base + 2)] + spec.input_ids[2:]})
    assert torch.equal(x.run(fut), plain)
    # More one-token rows than the layout has room for (max_running_requests = 8): not this runner's batch.
    many = BatchSpec(
        ForwardMode.EXTEND,
        [5] * 9,
        [3] * 9,
        [rows[0]] * 9,
        [4] * 9,
        torch.zeros(9, dtype=torch.int64),
        logits_indices=list(range(9)),
        extend_prefix_lens=[3] * 9,
        extend_seq_lens=[1] * 9,
    )
    assert not x.fits(many)
    # Likewise more multi-token requests than the layout has room for (here min(32 // 2, 32, 8) = 8).
    prompts = BatchSpec(
        ForwardMode.EXTEND,
        [5] * 18,
        [0, 1] * 9,
        [rows[0]] * 9,
        [2] * 9,
        torch.zeros(18, dtype=torch.int64),
        logits_indices=list(range(1, 18, 2)),
        extend_prefix_lens=[0] * 9,
        extend_seq_lens=[2] * 9,
    )
    assert not x.fits(prompts)
    assert x.fits(
        BatchSpec(
            **{
                **prompts.__dict__,
                "input_ids": [5] * 16,
                "positions": [0, 1] * 8,
                "req_pool_indices": [rows[0]] * 8,
                "seq_lens": [2] * 8,
                "out_cache_loc": torch.zeros(16, dtype=torch.int64),
                "logits_indices": list(range(1, 16, 2)),
                "extend_prefix_lens": [0] * 8,
                "extend_seq_lens": [2] * 8,
            }
        )
    )
    assert not x.fits(
        BatchSpec(
            ForwardMode.EXTEND,
            [5] * 33,
            list(range(33)),
            [rows[0]],
            [33],
            torch.zeros(33, dtype=torch.int64),
            [32],
            [0],
            [33],
        )
    )  # past the largest bucket
    release(r, slots, rows)


def _attach_whole(engine) -> list[int]:
    engine.runner.graphs = GraphRunner(engine.runner, None, "whole", 32)  # the 40-token prompt: chunks
    x = engine.runner.graphs.whole
    sizes, run = [], x.run
    x.run = lambda spec: sizes.append(len(spec.input_ids)) or run(spec)
    return sizes


@pytest.mark.parametrize("arch", ["llama"])  # the other architectures' forwards: test_whole_extend_graph_matches_eager
def test_whole_extend_graph_generates_what_eager_does(tiny_dirs, arch):
    expected, got, sizes, engine = generate_through_runner(lambda **kw: _engine(tiny_dirs[arch], **kw), _attach_whole)
    assert got == expected
    assert max(sizes) > 16  # a prefill chunk with decodes riding along went through the whole graph
    assert engine.flush_cache()
    assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size


def test_decode_graph_kind_matches_eager(tiny_dirs):
    """The decode kind's segments (a one-layer head, the rest with the logits) as plain calls: a batch padded to
    its bucket gives the eager logits of its rows, also with ids that are futures, and writes no slot but its
    own and the padding slot."""
    r = _engine(tiny_dirs["llama"]).runner
    graphs = GraphRunner(r, 8, "off", 16)
    assert graphs.decode is not None and graphs.whole is None and graphs.piecewise is None
    kv = r.token_to_kv_pool
    for bs in (1, 3):  # 3 pads to the bucket of 4
        spec, slots, rows = decode_spec(r, bs, 5)
        for buf in (kv.k_buffer, kv.v_buffer):
            for layer in buf:
                layer[slots].normal_()
        eager = r.forward(spec.build(r.device, None))
        untouched = [b[layer].clone() for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        assert graphs.decode.fits(spec)
        got = graphs.run(spec)
        assert got.shape == eager.shape == (bs, r.vocab_size)
        assert ((got - eager).norm() / eager.norm()).item() < 1e-5
        others = torch.ones(kv.k_buffer[0].shape[0], dtype=torch.bool)
        others[0] = others[spec.out_cache_loc] = False  # the padding slot and the batch's own (rewritten: a
        # padded batch computes them in another GEMM shape, equal to rounding)
        for before, now in zip(untouched, [b[layer] for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]):
            assert torch.equal(now[others], before[others])
        base = r.store_futures(torch.tensor(spec.input_ids, device=r.device))
        fut = BatchSpec(**{**spec.__dict__, "input_ids": [-(base + 1 + i) for i in range(bs)]})
        assert torch.equal(graphs.run(fut), got)
        release(r, slots, rows)
    row = r.req_to_token_pool.dummy_row
    big = BatchSpec(ForwardMode.DECODE, [5] * 9, [3] * 9, [row] * 9, [4] * 9, torch.zeros(9, dtype=torch.int64))
    assert not graphs.decode.fits(big) and graphs.run(big) is None  # past the largest bucket: eager
