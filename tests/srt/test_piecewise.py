"""Piecewise forward (everything between attention calls as one piece, attention eager): the same logits and
greedy outputs as the plain forward. On CPU the pieces run as calls; on CUDA they are captured graphs."""
import pytest
import torch

import radixlm
from radixlm.srt.model_executor.piecewise_graph_runner import PiecewiseGraphRunner, token_buckets
from tests.helpers import assert_runner_matches_eager, generate_through_runner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(path, **kw):
    engine = radixlm.Engine(str(path), log_level="warning", max_total_tokens=4096, device=DEVICE, dtype="float32",
                            attention_backend="torch_native", disable_cuda_graph=True, **kw)
    # The pieces are cut from the module path, so eager runs that path too (on CPU the runner would take the
    # flat layer loop, the same math in another op order: its K/V differ in the last bits).
    engine.runner.model.model.cpu_path = None
    return engine


def test_token_buckets():
    assert token_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert token_buckets(16) == [16]
    assert token_buckets(4096)[-1] == 4096 and token_buckets(4096) == sorted(set(token_buckets(4096)))
    assert 288 in token_buckets(4096)  # a 256-token chunk with 32 decodes riding along pads to nothing


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_piecewise_forward_matches_eager(tiny_dirs, arch):
    r = _engine(tiny_dirs[arch]).runner
    r.piecewise_runner = PiecewiseGraphRunner(r, 48)
    assert_runner_matches_eager(r, lambda spec: r.forward(spec.build(r.device, None)))


def _attach_pieces(engine) -> list[int]:
    pw = engine.runner.piecewise_runner = PiecewiseGraphRunner(engine.runner, 32)  # the 40-token prompt: chunks
    sizes, run = [], pw.forward
    pw.forward = lambda fb: sizes.append(fb.num_tokens) or run(fb)
    return sizes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_piecewise_generates_what_eager_does(tiny_dirs, arch):
    expected, got, sizes, engine = generate_through_runner(lambda **kw: _engine(tiny_dirs[arch], **kw), _attach_pieces)
    assert got == expected
    assert max(sizes) > 16  # a prefill chunk with decodes riding along went through the pieces
    assert engine.flush_cache()
    assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
