"""Whole-forward graphs for extend and mixed batches (ExtendGraphRunner, Triton backend): the metadata in a
fixed layout with room to spare gives the logits the eager forward gives, futures are resolved inside, batches
that do not fit fall back, and generation matches eager. On CPU the static path runs as plain calls with the
kernels in Triton's interpreter; on CUDA it is captured."""
import pytest
import torch

import radixlm
from benchmarks.bench_decode import mixed_spec, release
from radixlm.kernels import HAS_TRITON
from radixlm.srt.model_executor.extend_graph_runner import ExtendGraphRunner
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode
from tests.helpers import assert_runner_matches_eager, generate_through_runner

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(path, **kw):
    from radixlm.srt.layers.ops import triton_ops

    engine = radixlm.Engine(str(path), log_level="warning", max_total_tokens=4096, device=DEVICE, dtype="float32",
                            attention_backend="triton", disable_cuda_graph=True, max_running_requests=8, **kw)
    engine.runner.model.set_kernel_ops(triton_ops())
    assert engine.runner.model.model.cpu_path is None
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_whole_extend_graph_matches_eager(tiny_dirs, arch):
    r = _engine(tiny_dirs[arch]).runner
    x = ExtendGraphRunner(r, 48)

    def whole(spec):
        assert x.can_run(spec)
        return x.run(spec)

    assert_runner_matches_eager(r, whole)


def test_whole_extend_graph_resolves_futures_and_falls_back(tiny_dirs):
    engine = _engine(tiny_dirs["llama"])
    r = engine.runner
    x = ExtendGraphRunner(r, 32)
    spec, slots, rows = mixed_spec(r, 2, 6, 9)
    plain = x.run(spec)
    # The two decode rows' ids as futures: slots j of the future map hold the tokens.
    base = r.store_futures(torch.tensor(spec.input_ids[:2], device=r.device))
    fut = BatchSpec(**{**spec.__dict__, "input_ids": [-(base + 1), -(base + 2)] + spec.input_ids[2:]})
    assert torch.equal(x.run(fut), plain)
    # More one-token rows than the layout has room for (max_running_requests = 8): not this runner's batch.
    many = BatchSpec(ForwardMode.EXTEND, [5] * 9, [3] * 9, [rows[0]] * 9, [4] * 9, torch.zeros(9, dtype=torch.int64),
                     logits_indices=list(range(9)), extend_prefix_lens=[3] * 9, extend_seq_lens=[1] * 9)
    assert not x.can_run(many)
    # Likewise more multi-token requests than the layout has room for (here min(32 // 2, 32, 8) = 8).
    prompts = BatchSpec(ForwardMode.EXTEND, [5] * 18, [0, 1] * 9, [rows[0]] * 9, [2] * 9,
                        torch.zeros(18, dtype=torch.int64), logits_indices=list(range(1, 18, 2)),
                        extend_prefix_lens=[0] * 9, extend_seq_lens=[2] * 9)
    assert not x.can_run(prompts)
    assert x.can_run(BatchSpec(**{**prompts.__dict__, "input_ids": [5] * 16, "positions": [0, 1] * 8,
                                  "req_pool_indices": [rows[0]] * 8, "seq_lens": [2] * 8,
                                  "out_cache_loc": torch.zeros(16, dtype=torch.int64),
                                  "logits_indices": list(range(1, 16, 2)), "extend_prefix_lens": [0] * 8,
                                  "extend_seq_lens": [2] * 8}))
    assert not x.can_run(BatchSpec(ForwardMode.EXTEND, [5] * 33, list(range(33)), [rows[0]], [33],
                                   torch.zeros(33, dtype=torch.int64), [32], [0], [33]))  # past the largest bucket
    release(r, slots, rows)


def _attach_whole(engine) -> list[int]:
    x = engine.runner.extend_runner = ExtendGraphRunner(engine.runner, 32)  # the 40-token prompt: chunks
    sizes, run = [], x.run
    x.run = lambda spec: sizes.append(len(spec.input_ids)) or run(spec)
    return sizes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_extend_graph_generates_what_eager_does(tiny_dirs, arch):
    expected, got, sizes, engine = generate_through_runner(lambda **kw: _engine(tiny_dirs[arch], **kw), _attach_whole)
    assert got == expected
    assert max(sizes) > 16  # a prefill chunk with decodes riding along went through the whole graph
    assert engine.flush_cache()
    assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
