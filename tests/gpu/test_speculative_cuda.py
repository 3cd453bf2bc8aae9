"""Speculative decoding (n-gram drafts) on CUDA: a small random Llama (GPU-kernel-sized heads) in float32, greedy
answers identical to plain decoding with CUDA graphs (decode and extend graphs: a verify step is an extend) and
overlap on, with graphs off, with overlap off, and with a JSON schema; drafts are accepted (a prompt answered
before drafts from the radix tree's continuation). Random weights, not the embedded model: the GPU machine has
no copy of the GGUF. Run on a GPU machine: `python -m pytest -m gpu` (README)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import radixlm
from tests.helpers import assert_engine_idle, make_tiny_checkpoint, smollm_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PASSAGE = (
    "The Amazon River flows through Peru, Colombia and Brazil. It carries more water than any other river, "
    "and its basin holds the largest rainforest on Earth."
)
PROMPTS = [
    f"Copy the passage exactly.\nPassage: {PASSAGE}\nCopy:",
    "Repeat after me three times: red apples, green pears, yellow bananas. red apples, green pears,",
    "Write a short story about a lighthouse keeper.",
]
SCHEMA = {  # bounded, so that even random weights must close the object
    "type": "object",
    "properties": {"river": {"enum": ["Amazon", "Nile", "Congo"]}, "long": {"type": "boolean"}},
    "required": ["river", "long"],
}
MODEL = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=1024)
# Mixed chunks (the CUDA default) off in both engines: when a batch's prompts take two prefill steps (one deferred
# for in-batch prefix sharing, or a verify step between), mixed chunks decode the first ones inside the second
# step in one scheduler and not in another: different batches, whose rounding can flip a near-tied greedy pick.
COMMON = dict(log_level="warning", dtype="float32", max_total_tokens=8192, disable_mixed_chunk=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_cuda") / "llama"
    return str(make_tiny_checkpoint(d, "llama", tokenizer=smollm_tokenizer(), **MODEL))


@pytest.fixture(scope="module")
def plains(ckpt):
    """Plain decoding with the overlap scheduler (the CUDA default) or without it. Each speculative run is compared
    with the plain engine of its own scheduler: without overlap, jump-forward is on (`--jump-forward auto`), and a
    jump re-enters the forced text through an extend, so the positions after it are computed by other kernels
    (extend, not decode) than with overlap, which may round differently in float32. Against the overlap engine,
    the JSON-schema answer at overlap off differed on an H200 in two sessions while every other comparison held
    (on the CPU both schedulers' answers match); against its own scheduler the comparison measures speculation
    alone."""
    engines: dict[bool, radixlm.Engine] = {}

    def get(in_order: bool) -> radixlm.Engine:
        if in_order not in engines:
            engines[in_order] = radixlm.Engine(model_path=ckpt, **COMMON, disable_overlap_schedule=in_order)
        return engines[in_order]

    yield get
    for e in engines.values():
        e.shutdown()


@pytest.mark.parametrize("run", [{}, {"disable_cuda_graph": True}, {"disable_overlap_schedule": True}])
def test_greedy_answers_are_plain_decodings_on_cuda(ckpt, plains, run):
    plain = plains(run.get("disable_overlap_schedule", False))
    # Drafting at every batch size here: the measured gate judges by step times, and on a model this small (host
    # bound, random weights, few drafts accepted) it may close before any draft is accepted, which would leave
    # `accepted > 0` to chance. The gate never changes answers (its CPU tests), so pinning it loses nothing here.
    spec = radixlm.Engine(
        model_path=ckpt, **COMMON, speculative_algorithm="ngram", speculative_max_batch_size=64, **run
    )
    try:
        params = {"max_new_tokens": 48, "temperature": 0}
        # the plain answers from a cold cache in every run: a run after another would otherwise compute them
        # through cached prefixes (other kernels, other float32 rounding) and the comparison would depend on the
        # order the runs take
        plain.flush_cache()
        want = plain.generate(PROMPTS, params)
        accepted = 0
        for batch in (PROMPTS[:1], PROMPTS):  # batch 1, then 3 (the first prompt's answer now in the tree)
            got = spec.generate(batch, params)
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want[: len(batch)]]
            accepted += sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in got)
        assert accepted > 0
        constrained = {**params, "json_schema": json.dumps(SCHEMA)}
        a = spec.generate(PROMPTS[0], constrained)
        b = plain.generate(PROMPTS[0], constrained)
        assert a["output_ids"] == b["output_ids"]
        if a["meta_info"]["finish_reason"]["type"] == "stop":  # an answer cut at the limit is not yet JSON
            jsonschema.validate(json.loads(a["text"]), SCHEMA)
        assert_engine_idle(spec)
    finally:
        spec.shutdown()
