"""The in-process Engine on the embedded SmolLM2: batching, sampling options, streaming, bad input."""

import os
import subprocess
import sys

import pytest

import radixlm
from radixlm.srt.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError

GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = [
    "Hi",
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a land far, far away, there lived a",
    "Water boils at",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown",
]


def _idle_and_clean(engine):
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    engine.scheduler.check_invariants()


def test_batch_matches_each_prompt_alone(smol_engine):
    alone = [smol_engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    smol_engine.flush_cache()
    batch = smol_engine.generate(PROMPTS, GREEDY)
    assert [b["output_ids"] for b in batch] == alone
    assert len({len(smol_engine.tokenizer(p)["input_ids"]) for p in PROMPTS}) > 4  # lengths really differ
    _idle_and_clean(smol_engine)


def test_result_shape_and_usage(smol_engine):
    out = smol_engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 5
    assert meta["prompt_tokens"] == len(smol_engine.tokenizer("The capital of France is")["input_ids"])
    assert out["text"] == smol_engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_chat_answers_paris(smol_engine):
    out = smol_engine.chat(
        [{"role": "user", "content": "What is the capital of France?"}], {"temperature": 0, "max_new_tokens": 24}
    )
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_default_model_from_clean_cache_dir(tmp_path):
    """Fresh cache: the default model downloads, converts its tokenizer and answers."""
    code = (
        "import radixlm; e = radixlm.Engine(log_level='warning', max_total_tokens=2048); "
        "out = e.chat([{'role': 'user', 'content': 'What is the capital of France?'}], "
        "{'temperature': 0, 'max_new_tokens': 24}); print('ANSWER:', out['text'])"
    )
    env = {**os.environ, "RADIXLM_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Downloading the default model" in proc.stderr
    assert "Paris" in proc.stdout.split("ANSWER:")[1]
    assert (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()


def test_seeded_sampling_is_reproducible_and_batch_independent(smol_engine):
    sp = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "seed": 1234, "ignore_eos": True}
    a = smol_engine.generate("Tell me a story.", sp)["output_ids"]
    b = smol_engine.generate(["Tell me a story.", "Something else entirely"], [sp, {**sp, "seed": 7}])[0]["output_ids"]
    assert a == b
    c = smol_engine.generate("Tell me a story.", {**sp, "seed": 4321})["output_ids"]
    assert c != a


def test_n_samples_differ_and_first_keeps_seed(smol_engine):
    sp = {"temperature": 1.2, "max_new_tokens": 10, "seed": 99, "ignore_eos": True}
    one = smol_engine.generate("Write a word:", sp)
    many = smol_engine.generate("Write a word:", {**sp, "n": 3})
    assert len(many) == 3 and many[0]["output_ids"] == one["output_ids"]
    assert len({tuple(m["output_ids"]) for m in many}) > 1
    assert all(m["meta_info"]["cached_tokens"] > 0 for m in many[1:])  # the samples share the prompt's KV


def test_top_k_one_equals_greedy(smol_engine):
    g = smol_engine.generate("The sky is", GREEDY)["output_ids"]
    k1 = smol_engine.generate("The sky is", {"temperature": 0.8, "top_k": 1, "max_new_tokens": 12})["output_ids"]
    assert g == k1


def test_stop_strings_and_stop_token_ids(smol_engine):
    base = smol_engine.generate("1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
    assert " 6" in base["text"]
    cut = smol_engine.generate("1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 20, "stop": [" 6"]})
    assert cut["text"] == base["text"][: base["text"].index(" 6")]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 6"}
    kept = smol_engine.generate(
        "1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 20, "stop": " 6", "no_stop_trim": True}
    )
    assert kept["text"] == base["text"][: base["text"].index(" 6") + 2]
    stop_id = base["output_ids"][3]
    by_id = smol_engine.generate("1, 2, 3, 4,", {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_id]})
    assert by_id["output_ids"] == base["output_ids"][: base["output_ids"].index(stop_id) + 1]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_eos_and_ignore_eos(smol_engine):
    chat = [{"role": "user", "content": "Say hi."}]
    stopped = smol_engine.chat(chat, {"temperature": 0, "max_new_tokens": 64})
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped["output_ids"][-1] in smol_engine.loaded.config.eos_token_ids
    n = len(stopped["output_ids"])
    forced = smol_engine.chat(chat, {"temperature": 0, "max_new_tokens": n + 3, "ignore_eos": True})
    assert forced["meta_info"]["finish_reason"]["type"] == "length"
    assert len(forced["output_ids"]) == n + 3


def test_logit_bias_bans_and_forces_tokens(smol_engine):
    base = smol_engine.generate("The capital of France is", GREEDY)["output_ids"]
    banned = smol_engine.generate("The capital of France is", {**GREEDY, "logit_bias": {str(base[0]): -100}})[
        "output_ids"
    ]
    assert banned[0] != base[0] and base[0] not in banned
    forced_id = smol_engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = smol_engine.generate(
        "The capital of France is", {"temperature": 0.7, "seed": 3, "max_new_tokens": 4, "logit_bias": {forced_id: 100}}
    )
    assert forced["output_ids"] == [forced_id] * 4
    # a biased request batched with an unbiased one leaves the other's output alone
    both = smol_engine.generate(
        ["The capital of France is", "Water boils at"], [{**GREEDY, "logit_bias": {base[0]: -100}}, GREEDY]
    )
    assert both[0]["output_ids"] == banned
    assert both[1]["output_ids"] == smol_engine.generate("Water boils at", GREEDY)["output_ids"]
    with pytest.raises(InvalidRequest) as err:
        smol_engine.generate("Hi", {**GREEDY, "logit_bias": {10**7: 5}})
    assert err.value.param == "logit_bias"
    for bad in ({"5": 101}, {"x": 1}, {-1: 1}, [1, 2]):
        with pytest.raises(InvalidRequest, match="logit_bias"):
            smol_engine.generate("Hi", {**GREEDY, "logit_bias": bad})
    _idle_and_clean(smol_engine)


def test_min_new_tokens_blocks_eos(smol_engine):
    chat = [{"role": "user", "content": "Say hi."}]
    short = smol_engine.chat(chat, {"temperature": 0, "max_new_tokens": 64})
    n = len(short["output_ids"])
    longer = smol_engine.chat(chat, {"temperature": 0, "max_new_tokens": 64, "min_new_tokens": n + 2})
    assert len(longer["output_ids"]) >= n + 2


def test_penalties_change_repetitive_output(smol_engine):
    prompt = "apple apple apple apple apple apple"
    plain = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    ids = plain["output_ids"]
    assert len(set(ids)) < len(ids)  # greedy repeats itself here
    for key, value in [("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 1.8)]:
        pen = smol_engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, key: value})
        assert pen["output_ids"] != ids, key
        if key != "repetition_penalty":
            assert len(set(pen["output_ids"])) > len(set(ids)), key


def test_logprobs(smol_engine):
    out = smol_engine.generate(
        "The capital of France is",
        {"temperature": 0, "max_new_tokens": 4},
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t in lps] == out["output_ids"]
    assert all(lp <= 0 for lp, _ in lps)
    for (lp, tok), top in zip(lps, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy picks the top-1
        assert top[0][0] >= top[1][0] >= top[2][0]
    prompt_ids = smol_engine.tokenizer("The capital of France is")["input_ids"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t in inp] == prompt_ids and inp[0][0] is None
    assert all(lp is not None and lp <= 0 for lp, _ in inp[1:])


def test_streaming_concatenates_to_final_text(smol_engine):
    sp = {"temperature": 0, "max_new_tokens": 16}
    final = smol_engine.generate("Count: one, two,", sp)
    chunks = list(smol_engine.generate("Count: one, two,", sp, stream=True))
    assert len(chunks) > 3
    assert chunks[-1]["text"] == final["text"]
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(len(chunks) - 1))


def test_max_new_tokens_zero_prefills_only(smol_engine):
    out = smol_engine.generate("Hello there", {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"tempertaure": 0.5}, "tempertaure"),
    ],
)
def test_bad_sampling_params_name_the_field(smol_engine, params, field):
    with pytest.raises(InvalidRequest) as err:
        smol_engine.generate("Hello", params)
    assert err.value.param == field and field in str(err.value)
    assert smol_engine.generate("Hello", {"temperature": 0, "max_new_tokens": 2})["output_ids"]
    _idle_and_clean(smol_engine)


def test_bad_prompts(smol_engine):
    with pytest.raises(InvalidRequest, match="empty"):
        smol_engine.generate("", GREEDY)
    with pytest.raises(InvalidRequest, match="empty"):
        smol_engine.generate(input_ids=[], sampling_params=GREEDY)
    with pytest.raises(InvalidRequest, match="input_ids"):
        smol_engine.generate(input_ids=[1, 2, 10**9], sampling_params=GREEDY)
    too_long = "hello " * (smol_engine.loaded.config.context_length + 10)
    with pytest.raises(ContextLengthExceeded, match="maximum context length"):
        smol_engine.generate(too_long, GREEDY)
    with pytest.raises(ContextLengthExceeded, match="maximum context length"):
        smol_engine.generate("hi", {"max_new_tokens": smol_engine.loaded.config.context_length})
    # a batch with one bad prompt enqueues nothing
    with pytest.raises(InvalidRequest):
        smol_engine.generate(["fine", ""], GREEDY)
    assert smol_engine.generate("Hello", {"temperature": 0, "max_new_tokens": 2})["output_ids"]
    _idle_and_clean(smol_engine)


def test_device_out_of_memory_fails_its_batch_only(smol_engine, monkeypatch):
    import torch

    reference = smol_engine.generate(PROMPTS[:3], GREEDY)
    real, calls = smol_engine.runner.run_forward, []  # graph replay or eager forward: every device step

    def forward_that_runs_out_at_the_third_call(spec):
        calls.append(spec.mode)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real(spec)

    monkeypatch.setattr(smol_engine.runner, "run_forward", forward_that_runs_out_at_the_third_call)
    smol_engine.flush_cache()
    failed = smol_engine.generate(PROMPTS[:2], GREEDY)
    for out in failed:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 503 and "memory" in reason["message"]
        # one token from the extend and one from the decode that succeeded; with overlap scheduling (on by default
        # on CUDA) that decode's token is still in flight when the failure aborts the requests, so it is dropped
        assert len(out["output_ids"]) == (1 if smol_engine.scheduler.overlap else 2)
    _idle_and_clean(smol_engine)
    again = smol_engine.generate(PROMPTS[:3], GREEDY)
    assert [o["output_ids"] for o in again] == [r["output_ids"] for r in reference]
    assert smol_engine.flush_cache()
    smol_engine.scheduler.check_invariants()
    assert smol_engine.scheduler.kv_pool.available_size() == smol_engine.scheduler.kv_pool.size


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        radixlm.Engine(str(tmp_path / "nope"), log_level="warning")
    d = tmp_path / "gpt2ish"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        radixlm.Engine(str(d), log_level="warning")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        radixlm.Engine(str(empty), log_level="warning")
    with pytest.raises(TypeError, match="no_such_option"):
        radixlm.Engine(no_such_option=1)


def test_startup_extend_warmup_leaves_state_alone(smol_engine):
    """The start-up warm-up of the extend and mixed-step kernels (run on CUDA) writes only the padding slot:
    every KV slot and request row stays free and greedy outputs do not change."""
    r = smol_engine.runner
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    before = smol_engine.generate(input_ids=[1, 504, 3575, 282, 4649], sampling_params=params)["output_ids"]
    smol_engine.flush_cache()
    kv, rows = r.token_to_kv_pool.available_size(), r.req_to_token_pool.available_size()
    r._warm_extend()
    assert (r.token_to_kv_pool.available_size(), r.req_to_token_pool.available_size()) == (kv, rows)
    assert smol_engine.generate(input_ids=[1, 504, 3575, 282, 4649], sampling_params=params)["output_ids"] == before
    assert smol_engine.flush_cache()


def test_overlap_engine_idle_after_stop():
    """With overlap scheduling (the CUDA default; forced here) a step for a request that stopped on EOS is
    already launched when the stop is seen; generate runs it out, so the engine is idle when it returns."""
    from tests.helpers import assert_engine_idle

    engine = radixlm.Engine(force_overlap_schedule=True, log_level="warning", max_total_tokens=4096)
    try:
        for stream in (False, True):
            out = engine.generate(
                input_ids=[1, 504, 3575, 282], stream=stream, sampling_params={"temperature": 0, "max_new_tokens": 64}
            )
            last = list(out)[-1] if stream else out
            assert last["meta_info"]["finish_reason"]["type"] == "stop"
            assert engine.scheduler.inflight is None
            assert_engine_idle(engine)
    finally:
        engine.shutdown()
