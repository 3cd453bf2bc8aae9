"""The model shapes in benchmarks/configs, which GPU runs load with --load-format dummy: each loads as the shape
it is named for (the published Llama-3.1 sizes; for smollm2-135m, the embedded default model's own GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm.srt.model_loader.resolve import open_checkpoint

CONFIGS = Path(__file__).parents[2] / "benchmarks/configs"
SHAPE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")


@pytest.mark.parametrize(
    "name,shape",
    [
        ("llama-3.1-8b", (4096, 14336, 32, 32, 8, 128, 128256)),
        ("llama-3.1-70b", (8192, 28672, 80, 64, 8, 128, 128256)),
    ],
)
def test_llama_shapes(name, shape):
    cfg = open_checkpoint(str(CONFIGS / name), dummy=True)[0].config
    assert tuple(getattr(cfg, k) for k in SHAPE) == shape
    assert not cfg.tie_word_embeddings  # an untied head: its bytes count in the decode floor


def test_smollm_config_is_the_embedded_models_shape():
    dummy = open_checkpoint(str(CONFIGS / "smollm2-135m"), dummy=True)[0].config
    gguf = open_checkpoint(None)[0].config
    keys = (*SHAPE, "rope_theta", "tie_word_embeddings", "architecture", "qkv_bias", "qk_norm")
    assert {k: getattr(dummy, k) for k in keys} == {k: getattr(gguf, k) for k in keys}
    assert dummy.rms_norm_eps == pytest.approx(gguf.rms_norm_eps)
