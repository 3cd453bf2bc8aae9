"""The scheduler under pressure: sharing, chunking, eviction, retraction, aborts; nothing may leak."""

import random

import pytest

import radixlm
from tests.helpers import assert_engine_idle, make_tiny_checkpoint

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # A small vocabulary and wide logits: greedy choices are far from ties, so outputs compare exactly.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sched") / "llama", "llama", vocab_size=512)


# The scheduling loops every test below runs under: plain, overlapped (the GPU default; forced here on CPU),
# and overlapped with mixed chunked prefill.
MODES = {
    "plain": {},
    "overlap": {"force_overlap_schedule": True},
    "overlap-mixed": {"force_overlap_schedule": True, "enable_mixed_chunk": True},
}


def _engine(path, mode="plain", **kw):
    return radixlm.Engine(str(path), log_level="warning", **MODES[mode], **kw)


@pytest.mark.parametrize("mode", ["plain", "overlap"])
def test_shared_prefix_computes_a_fraction(tiny_dir, mode):
    rng = random.Random(0)
    prefix = [rng.randrange(3, 512) for _ in range(1000)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(20)] for _ in range(32)]
    sp = {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}
    results = {}
    for disable in (False, True):
        engine = _engine(tiny_dir, mode, disable_radix_cache=disable, max_total_tokens=40000)
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        results[disable] = ([o["output_ids"] for o in outs], engine.get_stats(), outs)
        assert_engine_idle(engine)
    (on_ids, on, on_outs), (off_ids, off, _) = results[False], results[True]
    assert on_ids == off_ids
    assert off["computed_prefill_tokens"] == 32 * 1020
    assert on["computed_prefill_tokens"] < 0.15 * off["computed_prefill_tokens"]
    assert on["cache_hit_rate"] > 0.9 and off["cache_hit_rate"] == 0
    assert sum(o["meta_info"]["cached_tokens"] >= 1000 for o in on_outs) == 31


@pytest.mark.parametrize("mode", list(MODES))
def test_chunked_prefill_matches_unchunked(tiny_dir, mode):
    rng = random.Random(1)
    long_prompt = [rng.randrange(3, 512) for _ in range(300)]
    sp = {**GREEDY, "max_new_tokens": 16, "ignore_eos": True}
    whole = _engine(tiny_dir, chunked_prefill_size=-1, max_total_tokens=4096)
    ref = whole.generate(input_ids=long_prompt, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    chunked = _engine(tiny_dir, mode, chunked_prefill_size=64, max_total_tokens=4096)
    out = chunked.generate(input_ids=long_prompt, sampling_params=sp, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == ref["output_ids"]
    assert whole.get_stats()["extend_steps"] == 1 and chunked.get_stats()["extend_steps"] == 5
    a, b = ref["meta_info"]["input_token_logprobs"], out["meta_info"]["input_token_logprobs"]
    assert len(a) == len(b) == 300 and [t for _, t in a] == [t for _, t in b]
    assert max(abs(x - y) for (x, _), (y, _) in zip(a[1:], b[1:])) < 1e-4
    assert_engine_idle(chunked)


@pytest.mark.parametrize(
    "policy,mode",
    [
        ("lpm", "plain"),
        ("dfs-weight", "plain"),
        ("fcfs", "plain"),
        ("lof", "plain"),
        ("random", "plain"),
        ("lpm", "overlap-mixed"),
    ],
)
def test_policies_give_same_greedy_outputs(tiny_dir, policy, mode):
    rng = random.Random(2)
    prefixes = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 9))] for _ in range(24)]
    sp = {**GREEDY, "max_new_tokens": 6, "ignore_eos": True}
    engine = _engine(tiny_dir, mode, schedule_policy=policy, max_total_tokens=4096)
    alone = _engine(tiny_dir, max_total_tokens=4096, disable_radix_cache=True)
    got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    assert got == [alone.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in prompts]
    assert engine.get_stats()["cache_hit_rate"] > 0.3
    assert_engine_idle(engine)


def test_seeded_sampling_and_min_tokens_agree_in_every_mode(tiny_dir):
    """Overlap launches a step's sampling before the step in flight is read back (unless penalties need its
    tokens): the seeds' step counters and the min_new_tokens ban must count the token still on the device."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 30))] for _ in range(12)]
    stops = list(range(3, 300))  # most of the vocabulary stops a request: the ban decides the lengths
    params = [
        {
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 100 + i,
            "max_new_tokens": 12,
            "min_new_tokens": 2 + i % 5,
            "stop_token_ids": stops,
        }
        for i in range(len(prompts))
    ]
    penalized = [{**p, "presence_penalty": 0.5, "repetition_penalty": 1.2} for p in params[:4]]
    results = {}
    for mode in MODES:
        engine = _engine(tiny_dir, mode, max_total_tokens=4096)
        results[mode] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        early = engine.scheduler.last_step.sampled_early
        results[mode, "penalized"] = [
            o["output_ids"] for o in engine.generate(input_ids=prompts[:4], sampling_params=penalized)
        ]
        penalized_early = engine.scheduler.last_step.sampled_early
        # With overlap, sampling goes out with the forward unless penalties read the previous step's tokens.
        assert (early, penalized_early) == ((False, False) if mode == "plain" else (True, False))
        assert_engine_idle(engine)
    for i, out in enumerate(results["plain"]):
        assert len(out) >= params[i]["min_new_tokens"]
    assert any(len(o) < 12 for o in results["plain"])  # the stop ids end some requests once allowed
    assert len({tuple(map(tuple, o)) for o in results.values()}) == 2  # plain, penalized: same in every mode
    for mode in MODES:
        assert results[mode] == results["plain"]
        assert results[mode, "penalized"] == results["plain", "penalized"]


@pytest.mark.parametrize("mode", list(MODES))
def test_abort_while_waiting_mid_chunk_and_decoding(tiny_dir, mode):
    engine = _engine(tiny_dir, mode, chunked_prefill_size=32, max_total_tokens=4096, max_running_requests=2)
    rng = random.Random(3)
    ids = [[rng.randrange(3, 512) for _ in range(n)] for n in (100, 20, 20, 20)]
    rids = [
        engine.add_request(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 50, "ignore_eos": True})[0]
        for p in ids
    ]
    done = {}

    def step():
        for u in engine.step():
            if u["finished"]:
                done[u["meta_info"]["id"]] = u["meta_info"]["finish_reason"]["type"]
        engine.scheduler.check_invariants()

    step()  # first chunk of the long prompt
    assert engine.scheduler.chunked is not None and engine.scheduler.chunked.rid == rids[0]
    assert engine.abort(rids[0])  # mid chunked prefill
    while not engine.scheduler.running:
        step()
    assert engine.abort(engine.scheduler.running[0].rid)  # decoding
    waiting = engine.scheduler.waiting[-1].rid
    assert engine.abort(waiting)  # never admitted
    assert not engine.abort("no-such-request")
    while engine.has_unfinished_requests():
        step()
    assert sorted(done.values()) == ["abort", "abort", "abort", "length"]
    assert_engine_idle(engine)


@pytest.mark.parametrize("mode", list(MODES))
def test_500_requests_with_sharing_aborts_eviction_and_retraction(tiny_dir, mode):
    rng = random.Random(4)
    prefixes = [[rng.randrange(3, 512) for _ in range(n)] for n in (24, 40, 56, 72, 90)]
    suffixes = [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 16))] for _ in range(16)]
    catalog = [tuple(p + s) for p in prefixes for s in suffixes]
    plan = [(rng.choice(catalog), rng.randrange(1, 25)) for _ in range(500)]

    # An optimistic decode reserve (low conservativeness) admits more than fits: decode must retract.
    engine = _engine(
        tiny_dir,
        mode,
        max_total_tokens=700,
        max_running_requests=24,
        chunked_prefill_size=48,
        schedule_conservativeness=0.05,
    )
    submitted, results, aborted_by_us, prompt_of = 0, {}, set(), {}
    while submitted < len(plan) or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 7)):
            if submitted < len(plan):
                prompt, max_new = plan[submitted]
                rid = engine.add_request(
                    input_ids=list(prompt), sampling_params={**GREEDY, "max_new_tokens": max_new}, rid=f"r{submitted}"
                )[0]
                prompt_of[rid] = (prompt, max_new)
                submitted += 1
        for u in engine.step():
            if u["finished"]:
                results[u["meta_info"]["id"]] = u
        if rng.random() < 0.15:
            live = [r for r in prompt_of if r not in results and r not in aborted_by_us]
            if live:
                victim = rng.choice(live)
                assert engine.abort(victim)
                aborted_by_us.add(victim)
        engine.scheduler.check_invariants()
    stats = engine.get_stats()
    assert len(results) == 500
    if mode == "overlap-mixed":  # decode rides along with prefills, and riders are dropped when KV is short
        assert stats["mixed_steps"] > 0
    else:
        assert stats["retractions"] > 0, "the KV budget must be small enough to force retraction"
    assert stats["evicted_tokens"] > 0
    assert stats["cache_hit_rate"] > 0.2
    assert {r for r, u in results.items() if u["meta_info"]["finish_reason"]["type"] == "abort"} == aborted_by_us
    assert_engine_idle(engine)

    reference = _engine(tiny_dir, max_total_tokens=4096, disable_radix_cache=True)
    alone = {}
    for rid, u in results.items():
        if rid in aborted_by_us:
            continue
        prompt, max_new = prompt_of[rid]
        if prompt not in alone:  # greedy with a larger budget is a prefix-extension of any smaller one
            alone[prompt] = reference.generate(
                input_ids=list(prompt), sampling_params={**GREEDY, "max_new_tokens": 24}
            )["output_ids"]
        full = alone[prompt]
        assert u["output_ids"] == full[: len(u["output_ids"])], rid
        reason = u["meta_info"]["finish_reason"]
        if reason["type"] == "length":
            assert len(u["output_ids"]) == max_new
        else:
            assert reason["type"] == "stop" and u["output_ids"] == full[: len(u["output_ids"])]
            assert u["output_ids"][-1] == 2
