"""Speculative decoding with n-gram drafts (`--speculative-algorithm ngram`), on the embedded model in fp32:
answers are exactly those of plain decoding (greedy, and sampled with the same seeds), in the plain and the
overlap scheduler; a constrained request whose drafts leave its grammar at the first token still ends in valid
JSON; stop strings, max_new_tokens and logprobs behave as without drafts; an abort mid-draft leaks nothing."""

from __future__ import annotations

import json
import math
from collections import Counter

import jsonschema
import pytest
import torch

import radixlm
from radixlm.srt.mem_cache.memory_pool import TokenToKVPool
from radixlm.srt.mem_cache.radix_cache import RadixCache
from radixlm.srt.speculative.ngram import NgramIndex
from tests.helpers import assert_engine_idle

PASSAGE = (
    "The Amazon River flows through Peru, Colombia and Brazil. It carries more water than any other river, "
    "and its basin holds the largest rainforest on Earth. The river was named by Francisco de Orellana in 1542."
)
COPY_HEAVY = [
    f"Copy the passage exactly.\nPassage: {PASSAGE}\nCopy:",
    f"{PASSAGE}\nQuote the first sentence of the text above word for word:",
    "Repeat after me three times: red apples, green pears, yellow bananas. red apples, green pears,",
    'Return the record unchanged.\nRecord: {"id": 17, "name": "Ada Lovelace", "born": 1815, "field": '
    '"mathematics"}\nRecord:',
]
FREE_FORM = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of copper.",
]
ENGINE_ARGS = dict(log_level="warning", max_total_tokens=4096, dtype="float32", quantization="none")


def _engine(**kw) -> radixlm.Engine:
    return radixlm.Engine(**ENGINE_ARGS, **kw)


@pytest.fixture(scope="module")
def plain():
    e = _engine(disable_overlap_schedule=True)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def engines():
    """The speculative engines, one per scheduler, made on first use and shared by the module's tests."""
    made = {}

    def get(mode: str) -> radixlm.Engine:
        if mode not in made:
            overlap = mode == "overlap"
            made[mode] = e = _engine(
                speculative_algorithm="ngram",
                speculative_max_batch_size=8,  # the batches below draft whatever they cost (the default measures)
                force_overlap_schedule=overlap,
                disable_overlap_schedule=not overlap,
            )
            assert e.scheduler.overlap == overlap and e.scheduler.drafter is not None
        return made[mode]

    yield get
    for e in made.values():
        e.shutdown()


@pytest.fixture(params=["plain", "overlap"])
def spec(request, engines):
    return engines(request.param)


@pytest.fixture
def spec_overlap(engines):
    """The CUDA default's scheduler, for the tests that need not run in both."""
    return engines("overlap")


def _texts(engine, prompts, params, **kw) -> list[dict]:
    out = engine.generate(prompts, params, **kw)
    return out if isinstance(out, list) else [out]


@pytest.fixture(scope="module")
def ref(plain):
    """Plain decoding's answers, computed once for both speculative engines."""
    memo = {}

    def get(prompts, params, **kw):
        key = json.dumps([prompts, params, kw], sort_keys=True)
        if key not in memo:
            memo[key] = _texts(plain, prompts, params, **kw)
        return memo[key]

    return get


# --- the drafts ------------------------------------------------------------------------------------------------
def test_ngram_index_proposes_what_followed_the_longest_match():
    ix = NgramIndex(2, 3)
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3]
    ix.sync(seq, 0)
    # the tail (1, 2, 3) occurred at the start, followed by 4, 9, ...; the shorter (2, 3) last before 5, 7
    assert ix.propose(3) == [4, 9, 2]
    ix.sync(seq + [5], 0)  # (3, 5) was followed by 7 at positions 6..7
    assert ix.propose(2) == [7, 1]
    ix.sync([8, 8], 0)  # shorter than what it holds: rebuilt
    assert ix.propose(4) == []
    ix.sync([8, 8, 8], 1)
    assert ix.propose(4) == [8]  # (8, 8) ended at 2, followed by the sequence's own last token
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_radix_continuation_reads_without_touching_the_tree():
    pool = TokenToKVPool(64, 1, 1, 2, torch.float32, "cpu")
    tree = RadixCache(pool)
    tree.insert([1, 2, 3, 4, 5, 6], pool.alloc(6))
    tree.insert([1, 2, 7, 8], pool.alloc(4))
    nodes = list(_nodes(tree.root))
    stamps = [n.last_access for n in nodes]
    assert tree.continuation([1, 2, 3], 2) == [4, 5]  # ends inside a node
    assert tree.continuation([1, 2], 3) in ([3, 4, 5], [7, 8])  # the most recently used branch
    assert tree.continuation([1, 2, 3, 4, 5, 6], 2) == []  # nothing cached after it
    assert tree.continuation([1, 9], 2) == []  # not cached in full
    assert list(_nodes(tree.root)) == nodes and [n.last_access for n in nodes] == stamps  # no split, no touch
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], pool.alloc(8))  # [7, 8] becomes a child of the [3..6] node
    nodes = list(_nodes(tree.root))
    stamps = [n.last_access for n in nodes]
    assert tree.continuation([1, 2, 3], 5) == [4, 5, 6, 7, 8]  # ends inside a node: its rest, then its child
    assert list(_nodes(tree.root)) == nodes and [n.last_access for n in nodes] == stamps  # no split, no touch


def _nodes(node):
    yield node
    for c in node.children.values():
        yield from _nodes(c)


# --- answers: exactly plain decoding's -------------------------------------------------------------------------
def _spec_meta(outs: list[dict]) -> tuple[int, int]:
    drafted = sum(o["meta_info"].get("spec_draft_tokens", 0) for o in outs)
    return drafted, sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)


def test_greedy_answers_are_plain_decodings(ref, spec):
    params = {"max_new_tokens": 40, "temperature": 0}
    prompts = COPY_HEAVY + FREE_FORM
    spec.flush_cache()
    ref = ref(prompts, params)
    got = _texts(spec, prompts[:1], params) + _texts(spec, prompts[1:], params)  # batch 1, then batch 6
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in ref]
    drafted, accepted = _spec_meta(got[: len(COPY_HEAVY)])
    assert drafted >= 40 and accepted >= 0.5 * drafted, (drafted, accepted)  # the copies are drafted, mostly right
    # Asked again, the radix tree holds each answer past its prompt: the drafts are those answers.
    again = _texts(spec, prompts, params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in ref]
    drafted, accepted = _spec_meta(again)
    assert accepted >= 0.9 * drafted and accepted >= 100, (drafted, accepted)
    assert_engine_idle(spec)


def test_sampled_answers_are_plain_decodings_seed_for_seed(ref, spec_overlap):
    prompts = [COPY_HEAVY[0], COPY_HEAVY[2]] * 4
    params = [{"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": s} for s in range(8)]
    ref = ref(prompts, params)
    got = _texts(spec_overlap, prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
    assert _spec_meta(got)[1] > 0


def _chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """The chi-square quantile for `df` degrees of freedom at the normal quantile alpha_z (3.09: p = 0.001),
    by Wilson and Hilferty's cube-root approximation."""
    h = 2 / (9 * df)
    return df * (1 - h + alpha_z * math.sqrt(h)) ** 3


def test_sampled_tokens_follow_plain_decodings_distribution(plain, engines):
    """Different seeds in the two runs: the tokens at a position where drafts are verified are drawn from the
    same distribution (a chi-square test at p = 0.001; every run is seeded, so it is deterministic). A verifier
    that favoured its drafts would put far more mass on the copied token."""
    prompt, position, n = COPY_HEAVY[2], 4, 64
    spec = engines("plain")
    counts = []
    for engine, base in ((plain, 1000), (spec, 5000)):
        toks = []
        for b in range(0, n, 8):
            params = [{"max_new_tokens": position + 1, "temperature": 1.0, "seed": base + b + i} for i in range(8)]
            toks += [o["output_ids"][position] for o in _texts(engine, [prompt] * 8, params)]
        counts.append(Counter(toks))
    common = [t for t in set(counts[0]) | set(counts[1]) if counts[0][t] + counts[1][t] >= 10]
    cells = [[c[t] for t in common] + [n - sum(c[t] for t in common)] for c in counts]
    cells = [[a, b] for a, b in zip(*cells) if a + b > 0]
    stat = sum((a - b) ** 2 / (a + b) for a, b in cells)  # two samples of equal size
    assert len(cells) >= 2
    assert stat < _chi2_critical(len(cells) - 1), (stat, cells)


def test_stops_lengths_and_logprobs_as_plain_decoding(ref, spec_overlap):
    prompts = [COPY_HEAVY[0], COPY_HEAVY[2], COPY_HEAVY[3]]
    cases = [
        {"max_new_tokens": 24, "temperature": 0, "stop": ["Brazil", "bananas"]},  # stop strings inside drafts
        {"max_new_tokens": 3, "temperature": 0},  # fewer tokens left than a draft
        {"max_new_tokens": 16, "temperature": 0, "stop": [" the"], "no_stop_trim": True},
        {"max_new_tokens": 12, "temperature": 0, "min_new_tokens": 10},
    ]
    for params in cases:
        got = _texts(spec_overlap, prompts, params)
        for a, b in zip(got, ref(prompts, params)):
            assert (a["text"], a["output_ids"]) == (b["text"], b["output_ids"]), params
            assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"], params
    params = {"max_new_tokens": 16, "temperature": 0}
    got = _texts(spec_overlap, prompts, params, return_logprob=True, top_logprobs_num=3)
    assert _spec_meta(got)[1] > 0
    for a, b in zip(got, ref(prompts, params, return_logprob=True, top_logprobs_num=3)):
        la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert [t[1] for t in la] == [t[1] for t in lb] == b["output_ids"]
        assert max(abs(x[0] - y[0]) for x, y in zip(la, lb)) < 1e-3
        ta, tb = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
        assert len(ta) == len(tb) == len(b["output_ids"])
        assert [[t[1] for t in row] for row in ta] == [[t[1] for t in row] for row in tb]


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "born": {"type": "integer"}},
    "required": ["name", "born"],
}


def test_drafts_that_leave_the_grammar_at_once_end_in_valid_json(ref, spec_overlap):
    """The shape that hung EAGLE with structured output: every draft of a constrained request starts with a
    token its grammar refuses. Here the radix tree holds a free-text answer to the same prompt, so the tree's
    continuation (prose) is the draft; it is cut before the first token and the answer is valid JSON, as plain
    decoding gives it. Asked again, the drafts are the cached JSON answer: every verified position is masked."""
    prompt = "Describe Ada Lovelace as a JSON object with her name and the year she was born."
    spec_overlap.flush_cache()
    ids = spec_overlap.tokenizer.encode(prompt)
    free = spec_overlap.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0})
    draft = spec_overlap.scheduler.tree_cache.continuation(ids, 4)
    assert draft == free["output_ids"][:4]
    assert not spec_overlap.tokenizer.decode(draft[:1]).strip().startswith(("{", "[")), draft
    params = {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    want = ref(None, params, input_ids=ids)[0]
    for _ in range(2):
        got = spec_overlap.generate(input_ids=ids, sampling_params=params)
        assert got["output_ids"] == want["output_ids"]
        jsonschema.validate(json.loads(got["text"]), SCHEMA)
    assert got["meta_info"]["spec_accepted_tokens"] >= 5  # the second answer was drafted from the first
    assert_engine_idle(spec_overlap)


def test_abort_mid_draft_leaks_nothing(spec):
    params = {"max_new_tokens": 64, "temperature": 0}
    rids = spec.add_request([COPY_HEAVY[0], COPY_HEAVY[1]], params)
    sch = spec.scheduler
    verified = False
    for _ in range(200):
        spec.step()
        if sch.last_step is not None and sch.last_step.mode == "verify":
            verified = True
            break
    assert verified
    if sch.overlap:  # the verify step is left in flight (the step before streams meanwhile): aborted in flight
        assert sch.inflight is not None and sch.inflight.drafts is not None
    for rid in rids:
        spec.abort(rid)
    while spec.has_unfinished_requests():
        spec.step()
    assert_engine_idle(spec)


def test_detokenizer_takes_two_updates_of_one_request_in_one_batch_in_order(plain):
    """A step that first finishes what was in flight and then runs a verify step sends two updates of one
    request in one batch; its text must be what the two updates give one batch at a time."""
    from radixlm.srt.managers.detokenizer import IncrementalDetokenizer
    from radixlm.srt.managers.io_struct import FinishReason, TokenOutput

    ids = plain.tokenizer.encode(" The Amazon River flows through Peru, Colombia and Brazil.")
    cuts = [(0, 2), (2, 7), (7, len(ids))]

    def update(i, lo, hi):
        reason = FinishReason.stop("Brazil") if hi == len(ids) else None
        return TokenOutput("r", ids[lo:hi], 5, hi, 0, finished_reason=reason)

    texts = []
    for batches in ([[0], [1], [2]], [[0, 1], [2]], [[0, 1, 2]]):
        d = IncrementalDetokenizer(plain.tokenizer)
        d.register("r", stop=["Brazil"])
        deltas = [o.delta for b in batches for o in d.process([update(i, *cuts[i]) for i in b])]
        texts.append("".join(deltas))
    assert texts[0] == " The Amazon River flows through Peru, Colombia and "
    assert texts[1] == texts[2] == texts[0]


@pytest.mark.parametrize("host_tokens_match", [True, False])
def test_steps_without_drafts_keep_the_overlap(ref, spec_overlap, monkeypatch, host_tokens_match):
    """Under overlap, looking for drafts runs a step in order; text that never drafts must not pay that every
    step (on the GPU it cost 11-18% of plain decoding's speed): after a step that found no draft the next 1, 2,
    4 ... 16 steps run overlapped; and a look whose host tokens match nothing (Drafter.may_draft) is not run
    at all, only counted. The answers stay plain decoding's."""
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    s = spec_overlap.scheduler
    monkeypatch.setattr(s.drafter, "propose", lambda reqs, room: [[] for _ in reqs])  # free text: no n-gram hits
    asked = []
    monkeypatch.setattr(s.drafter, "may_draft", lambda reqs: asked.append(len(reqs)) or host_tokens_match)
    before = dict(in_order=s.stats.spec_in_order_steps, decode=s.stats.decode_steps, skipped=s.stats.spec_looks_skipped)
    got = _texts(spec_overlap, FREE_FORM[:1], params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref(FREE_FORM[:1], params)]
    in_order = s.stats.spec_in_order_steps - before["in_order"]
    decode = s.stats.decode_steps - before["decode"]
    skipped = s.stats.spec_looks_skipped - before["skipped"]
    # looks due before steps 1, 3, 6, 11, 20, 37 (fewer after an earlier test's pauses grew): run in order, or
    # skipped when may_draft says no (not asked when nothing is in flight: such a look costs nothing)
    assert decode >= 39 and 1 <= in_order + skipped <= 7 and set(asked) <= {1}, (in_order, skipped, asked)
    if host_tokens_match:
        assert skipped == 0 and len(asked) <= in_order, (in_order, asked)
    else:
        assert in_order <= 1 and skipped == len(asked) >= 1, (in_order, skipped, asked)
    assert_engine_idle(spec_overlap)


def test_server_streams_whole_answers_with_drafts_under_overlap():
    """`radixlm serve --speculative-algorithm ngram --force-overlap-schedule` through the openai client: n = 2
    streamed choices with logprobs end whole, as the same request answered at once; /metrics counts drafts."""
    import httpx
    import openai

    from tests.helpers import ServerProcess

    srv = ServerProcess(
        "--speculative-algorithm", "ngram", "--force-overlap-schedule", "--quantization", "none",
        "--speculative-max-batch-size", "8", "--max-total-tokens", "4096",
    )  # fmt: skip
    try:
        model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": f"Copy this exactly: {PASSAGE}"}]
        kw = dict(model=model, messages=msgs, max_tokens=40, temperature=0, n=2, logprobs=True, top_logprobs=2)
        whole = c.chat.completions.create(**kw)
        texts, ends, lps = ["", ""], [[], []], [0, 0]
        for chunk in c.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                ends[ch.index] += [ch.finish_reason] if ch.finish_reason else []
                lps[ch.index] += len(ch.logprobs.content) if ch.logprobs and ch.logprobs.content else 0
        assert texts == [ch.message.content for ch in whole.choices]
        assert ends == [[ch.finish_reason] for ch in whole.choices]
        assert lps == [len(ch.logprobs.content) for ch in whole.choices]
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        accepted = [line for line in metrics.splitlines() if line.startswith("radixlm_spec_accepted_tokens{")]
        assert accepted and float(accepted[0].split()[-1]) > 0
    finally:
        assert srv.stop() == 0


def test_the_default_measures_and_answers_as_plain_decoding(ref):
    """No --speculative-max-batch-size: the gate decides per batch size; what it decides never changes answers."""
    params = {"max_new_tokens": 40, "temperature": 0}
    e = _engine(speculative_algorithm="ngram", force_overlap_schedule=True)
    try:
        s = e.scheduler
        assert s.spec.gate is not None and s.drafter.cfg.measured
        got = _texts(e, COPY_HEAVY[:1], params) + _texts(e, FREE_FORM, params)
        want = ref(COPY_HEAVY + FREE_FORM, params)  # the greedy test's plain answers (memoized), less COPY_HEAVY[1:]
        want = want[:1] + want[len(COPY_HEAVY) :]
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
        assert s.spec.gate.step >= 40 and s.stats.spec_verify_steps >= 1  # it looked, and drafted at batch 1
        assert s.stats.spec_gate_closures == s.spec.gate.closures
        assert_engine_idle(e)
    finally:
        e.shutdown()
