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

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def _engine(path, **kw):
    from radixlm.srt.layers.ops import triton_ops

    engine = radixlm.Engine(str(path), log_level="warning", max_total_tokens=4096, device=DEVICE, dtype="float32",
                            attention_backend="triton", disable_cuda_graph=True, max_running_requests=8, **kw)
    engine.runner.model.set_kernel_ops(triton_ops())
    assert engine.runner.model.model.cpu_path is None
    return engine


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_whole_extend_graph_matches_eager(tiny_dirs, arch):
    engine = _engine(tiny_dirs[arch])
    r = engine.runner
    x = ExtendGraphRunner(r, 48)
    kv = r.token_to_kv_pool
    # 3 decodes + a 21-token prompt (24 tokens, padded to 32), then a prompt alone filling its bucket exactly.
    for decodes, prompt in ((3, 21), (0, 16)):
        ids = torch.randint(3, 200, (decodes + prompt,), generator=torch.Generator().manual_seed(prompt)).tolist()
        spec, slots, rows = mixed_spec(r, decodes, 5, prompt, ids, all_logits=True)
        torch.manual_seed(0)
        for buf in (kv.k_buffer, kv.v_buffer):  # the batch's new slots and the padding slot start as noise
            for layer in buf:
                layer[slots].normal_()
        assert x.can_run(spec)
        eager = r.forward(spec.build(r.device, None), piecewise=False)
        untouched = [b[layer].clone() for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        whole = x.run(spec)
        assert whole.shape == eager.shape == (decodes + prompt, r.vocab_size)
        assert _rel(whole, eager) < 1e-5
        # Padding rows wrote slot 0 only, so every other slot is as the eager pass left it.
        after = [b[layer] for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        for before, now in zip(untouched, after):
            assert torch.allclose(now[1:], before[1:], rtol=1e-5, atol=1e-6)
        release(r, slots, rows)


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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_extend_graph_generates_what_eager_does(tiny_dirs, arch):
    prompts = [[1, 504, 3575, 282, 4649, 314, 7042, 30, 198], [5, 6, 7], list(range(10, 50))]
    eager = _engine(tiny_dirs[arch], enable_mixed_chunk=True, chunked_prefill_size=16)
    expected = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=GREEDY)]
    engine = _engine(tiny_dirs[arch], enable_mixed_chunk=True, chunked_prefill_size=16)
    x = engine.runner.extend_runner = ExtendGraphRunner(engine.runner, 32)  # the 40-token prompt: chunks
    sizes, run = [], x.run
    x.run = lambda spec: sizes.append(len(spec.input_ids)) or run(spec)
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == expected
    assert max(sizes) > 16  # a prefill chunk with decodes riding along went through the whole graph
    assert engine.flush_cache()
    assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
