"""The Triton attention backend and the Triton layer ops inside the real model, against the torch-native path
and transformers. On CPU the kernels run in Triton's interpreter (tests/conftest.py), on CUDA compiled."""

import pytest
import torch

import radixlm
from radixlm.kernels import HAS_TRITON
from radixlm.srt.layers.attention import resolve_backend
from tests.helpers import forward_logits, hf_logits

# Also in the GPU suite (`-m gpu`): on CUDA these run the real kernels and capture real graphs.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton (in the test extra)")]

IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 1780, 314, 260, 3575, 282, 19628, 47, 2, 17, 9, 300, 77, 5]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_engine(path, **kw):
    from radixlm.srt.layers.ops import triton_ops

    # fp32 on CUDA too (its default would be bf16): the bounds below are for the math, not for rounding
    engine = radixlm.Engine(
        str(path),
        log_level="warning",
        max_total_tokens=2048,
        attention_backend="triton",
        device=DEVICE,
        dtype="float32",
        **kw,
    )
    engine.runner.model.set_kernel_ops(triton_ops())  # on CPU the runner would pick the torch references
    assert engine.runner.model.model.cpu_path is None  # the module path runs, not the flat CPU loop
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_triton_backend_logits_match_transformers(tiny_dirs, arch):
    engine = _triton_engine(tiny_dirs[arch])
    assert engine.runner.attn_backend_name == "triton"
    _, ref = hf_logits(tiny_dirs[arch], IDS, device=DEVICE)
    whole = forward_logits(engine, IDS)
    assert ((whole - ref).norm() / ref.norm()).item() < 1e-4
    # a cached prefix read through req_to_token, then the rest (the last split leaves a one-token extend, which
    # runs through the decode kernel): the same logits
    for split in (1, 9, len(IDS) - 1):
        parts = forward_logits(engine, IDS, split=split)
        assert ((parts - whole).norm() / whole.norm()).item() < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_generates_what_torch_native_does(tiny_dirs, arch):
    prompts = [IDS, IDS[:7], IDS[3:] + IDS[:4], IDS[:15]]  # ragged, with shared prefixes
    ref = radixlm.Engine(
        str(tiny_dirs[arch]),
        log_level="warning",
        max_total_tokens=2048,
        device=DEVICE,
        attention_backend="torch_native",
        dtype="float32",
    )  # as _triton_engine (CUDA: bf16)
    expected = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=GREEDY)]
    # The CUDA default's shape (overlap, mixed decode + prompt-chunk steps): it runs every kernel path the plain
    # schedule does and more (the kernels run 16x slower in Triton's interpreter on CPU: one schedule)
    configs = [{"force_overlap_schedule": True, "enable_mixed_chunk": True, "chunked_prefill_size": 8}]
    for kw in configs:
        engine = _triton_engine(tiny_dirs[arch], **kw)
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert got == expected, kw
        assert engine.flush_cache()
        engine.scheduler.check_invariants()
        assert engine.scheduler.kv_pool.available_size() == engine.scheduler.kv_pool.size


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "torch_native"
    assert resolve_backend("triton", "cpu") == "triton"
    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        resolve_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("magic", "cpu")
    # FlashInfer has no kernels for a 16-wide head (the tiny test checkpoints): auto picks Triton on CUDA.
    assert resolve_backend("auto", "cuda", head_dim=16) == "triton"
    with pytest.raises(ValueError, match="head sizes"):
        resolve_backend("flashinfer", "cuda", head_dim=16)
    assert resolve_backend("auto", "cuda", head_dim=64, dtype=torch.float32) == "triton"  # FlashInfer has no fp32
    assert resolve_backend("auto", "cuda", head_dim=64, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3") == "triton"
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        resolve_backend("flashinfer", "cuda", head_dim=64, dtype=torch.float32)
