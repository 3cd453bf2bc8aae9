"""Piecewise forward (everything between attention calls as one piece, attention eager): the same logits and
greedy outputs as the plain forward. On CPU the pieces run as calls; on CUDA they are captured graphs."""

import pytest
import torch

import radixlm
from radixlm.srt.model_executor.graph_runner import LADDER, GraphRunner, buckets, plan
from tests.helpers import assert_runner_matches_eager, generate_through_runner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # also in the GPU suite: on CUDA the pieces are captured graphs


def _engine(path, **kw):
    engine = radixlm.Engine(
        str(path),
        log_level="warning",
        max_total_tokens=4096,
        device=DEVICE,
        dtype="float32",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        **kw,
    )
    # The pieces are cut from the module path, so eager runs that path too (on CPU the runner would take the
    # flat layer loop, the same math in another op order: its K/V differ in the last bits).
    engine.runner.model.model.cpu_path = None
    return engine


def test_one_ladder_for_every_kind():
    assert buckets(1, 8) == [1, 2, 4, 8] and buckets(16, 100) == [16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100]
    assert buckets(16, 16) == [16]
    ext = buckets(16, 4096)
    assert ext[-1] == 4096 and ext == sorted(set(ext)) and set(ext) <= set(LADDER)
    assert 288 in ext and 544 in ext  # a 256- or 512-token chunk with 32 decodes riding along pads to nothing


def test_plans_cut_the_forward_at_the_seam():
    """Decode: a one-layer head graph and the rest; whole: one graph; piecewise: graphs between attentions. Every
    stage of the forward is in exactly one segment, in order."""
    for kind in ("decode", "whole", "piecewise"):
        segs = plan(kind, 3)
        ops = [op for s in segs for op in s.ops]
        assert ops == [("embed", 0)] + [(st, i) for i in range(3) for st in ("pre", "attn", "post")] + [("norm", 0)] + (
            [("logits", 0)] if kind == "decode" else []
        )
    assert [len(s.ops) for s in plan("decode", 3)] == [4, 8] and plan("decode", 1)[0].ops[-1] == ("logits", 0)
    pw = plan("piecewise", 3)
    assert [s.graphed for s in pw] == [True, False] * 3 + [True]
    assert all(s.ops == [("attn", i)] for i, s in enumerate(pw[1::2]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_piecewise_forward_matches_eager(tiny_dirs, arch):
    r = _engine(tiny_dirs[arch]).runner
    pw = GraphRunner(r, None, "piecewise", 48).piecewise
    assert_runner_matches_eager(r, lambda spec: pw.run(spec, r.prepare(r.build(spec))))


def _attach_pieces(engine) -> list[int]:
    graphs = engine.runner.graphs = GraphRunner(engine.runner, None, "piecewise", 32)  # the 40-token prompt: chunks
    pw = graphs.piecewise
    sizes, run = [], pw.run
    pw.run = lambda spec, live: sizes.append(len(spec.input_ids)) or run(spec, live)
    return sizes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_piecewise_generates_what_eager_does(tiny_dirs, arch):
    expected, got, sizes, engine = generate_through_runner(lambda **kw: _engine(tiny_dirs[arch], **kw), _attach_pieces)
    assert got == expected
    assert max(sizes) > 16  # a prefill chunk with decodes riding along went through the pieces
    assert engine.flush_cache()
    assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
