"""Speculative decoding (n-gram drafts) on CUDA: the embedded model in float32, greedy answers identical to plain
decoding with CUDA graphs (decode and extend graphs: a verify step is an extend) and overlap on, with graphs
off, and with a JSON schema; drafts are accepted. Run on a GPU machine: `python -m pytest -m gpu` (README)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

import radixlm
from tests.helpers import assert_engine_idle

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
SCHEMA = {
    "type": "object",
    "properties": {"river": {"type": "string", "maxLength": 16}, "countries": {"type": "integer"}},
    "required": ["river", "countries"],
}
COMMON = dict(log_level="warning", dtype="float32", quantization="none", max_total_tokens=8192)


@pytest.fixture(scope="module")
def plain():
    e = radixlm.Engine(**COMMON)
    yield e
    e.shutdown()


@pytest.mark.parametrize("run", [{}, {"disable_cuda_graph": True}, {"disable_overlap_schedule": True}])
def test_greedy_answers_are_plain_decodings_on_cuda(plain, run):
    spec = radixlm.Engine(**COMMON, speculative_algorithm="ngram", **run)
    try:
        params = {"max_new_tokens": 48, "temperature": 0}
        want = plain.generate(PROMPTS, params)
        for batch in (PROMPTS[:1], PROMPTS):  # batch 1, then 3
            got = spec.generate(batch, params)
            assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want[: len(batch)]]
        assert sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in got) > 0
        constrained = {**params, "json_schema": json.dumps(SCHEMA)}
        a = spec.generate(PROMPTS[0], constrained)
        b = plain.generate(PROMPTS[0], constrained)
        assert a["output_ids"] == b["output_ids"]
        jsonschema.validate(json.loads(a["text"]), SCHEMA)
        assert_engine_idle(spec)
    finally:
        spec.shutdown()
