"""The engine on CUDA: every attention backend against transformers, graphs against eager, overlap on and off,
mixed chunks, each kind of extend graph. Tiny random checkpoints with 128-wide heads (the kernel shapes of the
8B model) and one with the embedded SmolLM2's attention shape.

What is expected, per dtype:
- bfloat16: our logits' relative error against transformers' float32 forward stays within transformers' own
  bf16 error (x1.25, +0.002), and top-1 agreement with float32 within 3 points of transformers' bf16 agreement.
  Greedy outputs may differ where bf16 rounding flips a near-tie (the random models have many): graphs and
  eager must still agree, since they compute the same batch shapes.
- float32: greedy 64-token outputs identical with graphs + overlap, eager, overlap off and mixed chunks (float32
  rounding is a million times smaller than any tie those models have; a difference is a bug).
Run on a GPU machine: `python -m pytest -m gpu` (README).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import radixlm
from tests.helpers import forward_logits, hf_logits, make_tiny_checkpoint, rel_err, smollm_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = ["torch_native", "triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
ARCHS = ["llama", "qwen2", "qwen3", "smol"]
# transformers' default initializer range: logits as well conditioned as a random model's get
SIZES = dict(
    hidden_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=1024,
    initializer_range=0.02,
)
# The embedded SmolLM2's attention shape: 64-wide heads, 9 query heads over 3 KV heads (a GQA group of 3)
SMOL = dict(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    initializer_range=0.02,
)
GREEDY = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
RUNS = {
    "graphs+overlap": {},
    "eager": {"disable_cuda_graph": True},
    "no-overlap": {"disable_overlap_schedule": True},
    "mixed": {"enable_mixed_chunk": True, "chunked_prefill_size": 64},  # (mixed chunks are the CUDA default)
    "no-mixed": {"disable_mixed_chunk": True, "chunked_prefill_size": 64},
}


@pytest.fixture(scope="module")
def tok():
    return smollm_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    texts = [
        "The quick brown fox jumps over the lazy dog, and then some more words follow here.",
        "def add(a, b):\n    return a + b  # numbers, 1234567, and symbols {[(<>)]}",
        "Paris is the capital of France; Berlin, of Germany. Rome is older than both of them.",
    ]
    return [t for text in texts for t in tok(text)["input_ids"]] * 3


@pytest.fixture(scope="module")
def prompts(ids):
    return [ids[:n] for n in (5, 17, 40, 64, 81, 100, 33, 120)] + [ids[10:90]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("cuda_tiny")
    dirs = {a: make_tiny_checkpoint(root / a, a, tokenizer=tok, tie=a == "qwen3", **SIZES) for a in ARCHS[:3]}
    dirs["smol"] = make_tiny_checkpoint(root / "smol", "llama", tokenizer=tok, tie=True, **SMOL)
    return dirs


def _engine(path, backend: str, dtype: str, **kw):
    return radixlm.Engine(
        str(path),
        dtype=dtype,
        device="cuda",
        log_level="warning",
        max_total_tokens=8192,
        attention_backend=backend,
        cuda_graph_max_bs=16,
        **kw,
    )


def _greedy(engine, prompts) -> list[list[int]]:
    out = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert engine.flush_cache() and engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size
    return out


def _close(engine) -> None:
    engine.shutdown()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_within_transformers_own_rounding(checkpoints, ids, arch, backend):
    _, ref32 = hf_logits(checkpoints[arch], ids, dtype=torch.float32, device="cuda")
    _, ref16 = hf_logits(checkpoints[arch], ids, dtype=torch.bfloat16, device="cuda")
    engine = _engine(checkpoints[arch], backend, "bfloat16")
    ours = forward_logits(engine, ids)
    split = forward_logits(engine, ids, split=len(ids) // 3)  # two extends, the second over a cached prefix
    _close(engine)
    assert rel_err(ours, ref32) <= 1.25 * rel_err(ref16, ref32) + 0.002
    hf_agree = (ref16.argmax(-1) == ref32.argmax(-1)).float().mean().item()
    assert (ours.argmax(-1) == ref32.argmax(-1)).float().mean().item() >= hf_agree - 0.03
    assert rel_err(split, ours) < 0.01


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flashinfer"])  # FlashInfer runs 16-bit only
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_greedy_identical_with_graphs_eager_overlap_and_mixed(checkpoints, prompts, arch, backend):
    outs = {}
    for name, kw in RUNS.items():
        engine = _engine(checkpoints[arch], backend, "float32", **kw)
        # torch_native has no capturable decode; its prefill and mixed batches still run in piecewise graphs
        assert engine.runner.uses_cuda_graphs == (name != "eager" and backend != "torch_native")
        assert (engine.runner.graphs is not None) == (name != "eager")
        assert engine.scheduler.overlap == (name != "no-overlap")
        outs[name] = _greedy(engine, prompts)
        _close(engine)
    for name in RUNS:
        assert outs[name] == outs["graphs+overlap"], name


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch_native"])
def test_bf16_graphs_and_eager_agree(checkpoints, prompts, backend):
    """The same batch shapes with and without graphs: the same bf16 arithmetic, so the same greedy outputs."""
    outs = {}
    for name in ("graphs+overlap", "eager"):
        engine = _engine(checkpoints["llama"], backend, "bfloat16", **RUNS[name])
        outs[name] = _greedy(engine, prompts)
        _close(engine)
    assert outs["eager"] == outs["graphs+overlap"]


@pytest.mark.parametrize("backend", ["triton"] + (["flashinfer"] if "flashinfer" in BACKENDS else []))
def test_extend_graph_kinds_generate_what_eager_does(checkpoints, prompts, backend):
    """Mixed chunks through whole extend graphs (Triton) and piecewise graphs (either backend), in float32 where
    the backend runs it: the same greedy outputs as without extend graphs."""
    dtype = "bfloat16" if backend == "flashinfer" else "float32"
    kinds = ["piecewise"] + (["whole"] if backend == "triton" else [])
    outs = {}
    for kind in ["off"] + kinds:
        engine = _engine(checkpoints["llama"], backend, dtype, extend_cuda_graph=kind, **RUNS["mixed"])
        g = engine.runner.graphs
        assert (g.whole is not None) == (kind == "whole") and (g.piecewise is not None) == (kind == "piecewise")
        outs[kind] = _greedy(engine, prompts)
        _close(engine)
    for kind in kinds:
        assert outs[kind] == outs["off"], kind
