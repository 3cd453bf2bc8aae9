"""Piecewise forward (everything between attention calls as one piece, attention eager): the same logits and
greedy outputs as the plain forward. On CPU the pieces run as calls; on CUDA they are captured graphs."""
import pytest
import torch

import radixlm
from benchmarks.bench_decode import mixed_spec, release
from radixlm.srt.model_executor.piecewise_graph_runner import PiecewiseGraphRunner, token_buckets

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


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
    engine = _engine(tiny_dirs[arch])
    r = engine.runner
    r.piecewise_runner = PiecewiseGraphRunner(r, 48)
    kv = r.token_to_kv_pool
    # 3 decodes at context 5 + a 21-token prompt = 24 tokens, padded to the 32 bucket; then an exact bucket.
    for decodes, prompt in ((3, 21), (0, 16)):
        ids = torch.randint(3, 200, (decodes + prompt,), generator=torch.Generator().manual_seed(prompt)).tolist()
        spec, slots, rows = mixed_spec(r, decodes, 5, prompt, ids, all_logits=True)
        torch.manual_seed(0)
        for buf in (kv.k_buffer, kv.v_buffer):  # the batch's new slots and the padding slot start as noise
            for layer in buf:
                layer[slots].normal_()
        eager = r.forward(spec.build(r.device, None), piecewise=False)
        untouched = [b[layer].clone() for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        piecewise = r.forward(spec.build(r.device, None))
        assert piecewise.shape == eager.shape == (decodes + prompt, r.vocab_size)
        assert ((piecewise - eager).norm() / eager.norm()).item() < 1e-5
        # The pieces stored the same K/V as the eager pass into the batch's slots, and padding rows went to slot
        # 0 only (the reserved padding slot), so every other slot of the pool is as the eager pass left it.
        after = [b[layer] for b in (kv.k_buffer, kv.v_buffer) for layer in range(len(b))]
        for before, now in zip(untouched, after):
            assert torch.allclose(now[1:], before[1:], rtol=1e-5, atol=1e-6)
        release(r, slots, rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_piecewise_generates_what_eager_does(tiny_dirs, arch):
    prompts = [[1, 504, 3575, 282, 4649, 314, 7042, 30, 198], [5, 6, 7], list(range(10, 50))]
    eager = _engine(tiny_dirs[arch], enable_mixed_chunk=True, chunked_prefill_size=16)
    expected = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=GREEDY)]
    engine = _engine(tiny_dirs[arch], enable_mixed_chunk=True, chunked_prefill_size=16)
    pw = engine.runner.piecewise_runner = PiecewiseGraphRunner(engine.runner, 32)  # the 40-token prompt: chunks
    sizes, run = [], pw.forward
    pw.forward = lambda fb: sizes.append(fb.num_tokens) or run(fb)
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert got == expected
    assert max(sizes) > 16  # a prefill chunk with decodes riding along went through the pieces
    assert engine.flush_cache()
    assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
