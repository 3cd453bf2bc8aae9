"""Our model code against transformers' on the same weights (fp32, CPU)."""

import json

import pytest
import torch

import radixlm
from tests.helpers import TINY_ARCHS, forward_logits, hf_logits, make_tiny_checkpoint

PROMPT_IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 1780, 314, 260, 3575, 282, 19628, 47, 2, 17, 9, 300]


def _greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_logits_and_greedy_match_transformers(tiny_dirs, arch):
    engine = radixlm.Engine(str(tiny_dirs[arch]), log_level="warning", max_total_tokens=2048)
    ours = forward_logits(engine, PROMPT_IDS)
    ref_model, ref = hf_logits(tiny_dirs[arch], PROMPT_IDS)
    assert ref.std() > 0.5  # logits must be spread out, or greedy agreement proves little
    assert (ours - ref).abs().max().item() < 1e-4
    out = engine.generate(
        input_ids=PROMPT_IDS, sampling_params={"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    )
    assert out["output_ids"] == _greedy(ref_model, PROMPT_IDS, 64)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 64}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_in_two_extends_matches_one(tiny_dirs, arch):
    engine = radixlm.Engine(str(tiny_dirs[arch]), log_level="warning", max_total_tokens=2048)
    whole = forward_logits(engine, PROMPT_IDS)
    for split in (1, 7, 19):
        parts = forward_logits(engine, PROMPT_IDS, split=split)
        assert (parts - whole).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_cut_at_the_seam_matches_whole(tiny_dirs, arch):
    """The model's forward as the graph runner cuts it (every kind's segments, run in turn on one state) computes
    the same logits as the whole forward."""
    from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
    from radixlm.srt.model_executor.graph_runner import Stages, plan

    engine = radixlm.Engine(str(tiny_dirs[arch]), log_level="warning", max_total_tokens=2048)
    r = engine.runner
    row = r.req_to_token_pool.alloc()
    slots = r.token_to_kv_pool.alloc(len(PROMPT_IDS))
    r.req_to_token_pool.write(row, 0, slots)
    n = len(PROMPT_IDS)
    fb = ForwardBatch.build(
        ForwardMode.EXTEND,
        r.device,
        input_ids=PROMPT_IDS,
        positions=list(range(n)),
        req_pool_indices=[row],
        seq_lens=[n],
        out_cache_loc=slots,
        logits_indices=list(range(n)),
        extend_prefix_lens=[0],
        extend_seq_lens=[n],
    )
    fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r.req_to_token_pool, r.token_to_kv_pool, r.attn_backend
    with torch.inference_mode():
        r.attn_backend.init_forward_metadata(fb)
        whole = r.model(fb)
        stages = Stages(r.model)
        for kind in ("decode", "whole", "piecewise"):
            st: dict = {}
            for seg in plan(kind, r.config.num_layers):
                stages.run(seg.ops, st, fb)
            split = st["logits"] if kind == "decode" else r.model.logits(st["hidden"], fb)
            assert split.shape == whole.shape and (split - whole).abs().max().item() < 1e-4
    r.token_to_kv_pool.free(slots)
    r.req_to_token_pool.free(row)


def test_attention_sliced_by_query_rows_matches(tiny_dirs, monkeypatch):
    from radixlm.srt.layers.attention import torch_native

    engine = radixlm.Engine(str(tiny_dirs["qwen2"]), log_level="warning", max_total_tokens=2048)
    whole = forward_logits(engine, PROMPT_IDS, split=5)
    # a budget of a few rows' scores forces many SDPA slices per layer
    monkeypatch.setattr(torch_native, "_SCORE_BUDGET", 3 * 4 * len(PROMPT_IDS) * 4)
    sliced = forward_logits(engine, PROMPT_IDS, split=5)
    assert (sliced - whole).abs().max().item() < 1e-5
    out = engine.generate(input_ids=PROMPT_IDS, sampling_params={"temperature": 0, "max_new_tokens": 8})
    monkeypatch.undo()
    assert (
        out["output_ids"]
        == engine.generate(input_ids=PROMPT_IDS, sampling_params={"temperature": 0, "max_new_tokens": 8})["output_ids"]
    )


def test_untied_sharded_bf16_checkpoint(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "m", "llama", tie=False, dtype=torch.bfloat16, shards=3)
    assert (d / "model.safetensors.index.json").exists()
    assert len(list(d.glob("*.safetensors"))) >= 2
    auto = radixlm.Engine(str(d), log_level="warning", max_total_tokens=1024)
    assert auto.loaded.dtype == torch.float32  # dtype=auto follows the checkpoint, but CPU runs fp32
    _, ref = hf_logits(d, PROMPT_IDS, dtype=torch.float32)
    assert (forward_logits(auto, PROMPT_IDS) - ref).abs().max().item() < 1e-4
    bf16 = radixlm.Engine(str(d), log_level="warning", max_total_tokens=1024, dtype="bfloat16")
    assert bf16.loaded.dtype == torch.bfloat16
    rel = (forward_logits(bf16, PROMPT_IDS) - ref).norm() / ref.norm()
    assert rel < 0.05


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    d = make_tiny_checkpoint(tmp_path / "m", "llama", rope_scaling=scaling)
    assert json.loads((d / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    engine = radixlm.Engine(str(d), log_level="warning", max_total_tokens=1024)
    ids = (PROMPT_IDS * 8)[:150]
    _, ref = hf_logits(d, ids)
    assert (forward_logits(engine, ids) - ref).abs().max().item() < 1e-4


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(fp32_engine):
    smol_engine = fp32_engine
    from radixlm.srt.model_loader.default_model import default_model_path

    path = default_model_path()
    ids = smol_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    ref_model, ref = hf_logits(str(path.parent), ids, gguf_file=path.name)
    ours = forward_logits(smol_engine, ids)
    assert (ours - ref).abs().max().item() < 1e-3
    out = smol_engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    )
    assert out["output_ids"] == _greedy(ref_model, ids, 32)
