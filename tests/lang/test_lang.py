"""The frontend language (`import radixlm as sgl`) end to end on the embedded SmolLM2: its primitives.

Every primitive runs on the in-process Engine (EngineBackend) and on a launched server (RuntimeEndpoint);
at temperature 0 both must give the same text and variables. `select` is checked against logprobs computed
directly with the Engine, fork's prefix sharing against the server's cached_tokens, run_batch against runs
one at a time, streaming against the final variables. Backends: conftest.py.
"""

from __future__ import annotations

import json
import math
import re
import uuid

import pytest

import radixlm as sgl

# --- programs used by several tests ------------------------------------------------------------------------
SPIDER_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer"}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}


@sgl.function
def roles_prog(s, question):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, stop="\n"))
    s += sgl.user("Is that right? Answer yes or no.")
    s += sgl.assistant(sgl.select("verdict", choices=["yes", "no"]))


@sgl.function
def begin_end_prog(s):
    s += sgl.system_begin()
    s += "Answer with numbers only."
    s += sgl.system_end()
    s += sgl.user_begin()
    s += "How many legs does a spider have?"
    s += sgl.user_end()
    s += sgl.assistant_begin()
    s += "Legs: " + sgl.gen("legs", regex=r"[0-9]{1,2}", max_tokens=4)
    s += sgl.assistant_end()
    s += sgl.user("Describe a spider as JSON.")
    s += sgl.assistant(sgl.gen("info", json_schema=json.dumps(SPIDER_SCHEMA), max_tokens=40))


@sgl.function
def choices_fork_prog(s, topic):
    s += f"Topic: {topic}.\n"
    s += "Tone: " + sgl.gen("tone", choices=["serious", "funny", "sad"]) + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Sentence {i + 1}:" + sgl.gen("line", max_tokens=8, stop="\n")
    forks.join()
    s += "Title:" + sgl.gen("title", max_tokens=6, stop="\n")


def _check_parity_program_results(name: str, st) -> None:
    """What each program must have made, whichever backend ran it (so the parity check is not vacuous)."""
    v = st.variables
    if name == "roles":
        assert v["answer"] and "\n" not in v["answer"]
        assert v["verdict"] in ("yes", "no")
        assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
        assert st.messages()[2]["content"] == v["answer"]
        assert st.messages()[4]["content"] == v["verdict"]
    elif name == "begin_end":
        assert re.fullmatch(r"[0-9]{1,2}", v["legs"])
        info = json.loads(v["info"])
        assert set(info) == {"name", "legs"} and isinstance(info["legs"], int)
        assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
        assert st.messages()[1]["content"] == "How many legs does a spider have?"
        assert st.messages()[2]["content"] == "Legs: " + v["legs"]
    else:
        assert v["tone"] in ("serious", "funny", "sad")
        assert isinstance(v["line"], list) and len(v["line"]) == 3
        assert all(isinstance(x, str) and x for x in v["line"])
        assert st.text().endswith("Title:" + v["title"])
        assert "Sentence 1:" not in st.text()  # gathered as variables, not appended to the parent


PARITY_RUNS = {
    "roles": lambda be: roles_prog.run(question="What is the capital of France?", backend=be, temperature=0),
    "begin_end": lambda be: begin_end_prog.run(backend=be, temperature=0),
    "choices_fork": lambda be: choices_fork_prog.run(topic="a rainy day", backend=be, temperature=0),
}


# --- every primitive, both native backends, identical results -----------------------------------------------
@pytest.mark.parametrize("name", sorted(PARITY_RUNS))
def test_engine_and_http_backends_give_identical_results(name, engine_backend, http_backend):
    local = PARITY_RUNS[name](engine_backend)
    remote = PARITY_RUNS[name](http_backend)
    for st in (local, remote):
        _check_parity_program_results(name, st)
    assert local.text() == remote.text()
    assert local.variables == remote.variables
    assert local.messages() == remote.messages()


def test_stop_string_is_not_part_of_the_variable(backend):
    # "Sentence 1:" continues with 7 tokens of text and then "\n" as the 8th: the stop string completes on the
    # last token max_tokens allows, and must still be cut off (OpenAI's stop semantics: the returned text never
    # holds the stop sequence; a stop *token* on the last allowed step is already treated that way)
    @sgl.function
    def prog(s):
        s += "Topic: a rainy day.\nTone: serious\nSentence 1:" + sgl.gen("line", max_tokens=8, stop="\n")
        s += "|" + sgl.gen("more", max_tokens=12, stop="\n")

    st = prog.run(backend=backend, temperature=0)
    assert st["line"] and "\n" not in st["line"], st["line"]
    assert st.get_meta_info("line")["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert "\n" not in st["more"], st["more"]
    assert st.text().endswith("Sentence 1:" + st["line"] + "|" + st["more"])


def test_role_blocks_use_the_model_chat_template(engine_backend, fp32_engine):
    st = roles_prog.run(question="What is 2+2?", backend=engine_backend, temperature=0)
    msgs = [{"role": m["role"], "content": m["content"]} for m in st.messages()]
    expected = fp32_engine.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert st.text() == expected


# --- select against logprobs computed with the Engine --------------------------------------------------------
SELECT_PROMPT = "Q: What is the capital of France?\nA: The capital of France is"
SELECT_CHOICES = [" London", " Berlin", " Paris", " a small village in Spain"]


def _direct_choice_logprobs(engine, prompt: str, choice: str) -> list[float]:
    """The logprob of each of `choice`'s tokens after `prompt`, straight from the Engine."""
    tok = engine.tokenizer
    prefix = tok(prompt, add_special_tokens=True)["input_ids"]
    ids = tok(prompt + choice, add_special_tokens=True)["input_ids"]
    assert ids[: len(prefix)] == prefix  # the choice starts on a token boundary (else the test is ill-posed)
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=len(prefix)
    )
    lps = [lp for lp, _tok in out["meta_info"]["input_token_logprobs"] if lp is not None]
    assert len(lps) == len(ids) - len(prefix)
    return lps


@sgl.function
def select_prog(s, choices, method):
    s += SELECT_PROMPT
    s += sgl.select("city", choices=choices, choices_method=method)


def test_select_picks_the_highest_length_normalized_logprob(backend, fp32_engine):
    direct = [_direct_choice_logprobs(fp32_engine, SELECT_PROMPT, c) for c in SELECT_CHOICES]
    means = [sum(x) / len(x) for x in direct]
    best = max(range(len(means)), key=lambda i: means[i])
    assert best != 0 and sorted(means)[-1] - sorted(means)[-2] > 0.01  # a pick that means something

    st = select_prog.run(choices=SELECT_CHOICES, method=sgl.token_length_normalized, backend=backend)
    assert st["city"] == SELECT_CHOICES[best]
    assert st.text() == SELECT_PROMPT + SELECT_CHOICES[best]
    meta = st.get_meta_info("city")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-3)
    for got, want in zip(meta["input_token_logprobs"], direct):
        assert got == pytest.approx(want, abs=1e-3)


def test_gen_with_choices_is_a_select(backend, fp32_engine):
    @sgl.function
    def prog(s):
        s += SELECT_PROMPT + sgl.gen("city", choices=SELECT_CHOICES)

    direct = [_direct_choice_logprobs(fp32_engine, SELECT_PROMPT, c) for c in SELECT_CHOICES]
    means = [sum(x) / len(x) for x in direct]
    st = prog.run(backend=backend)
    assert st["city"] == SELECT_CHOICES[max(range(len(means)), key=lambda i: means[i])]
    assert st.get_meta_info("city")["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-3)


def test_select_after_a_trailing_space_scores_the_merged_token(backend, fp32_engine):
    """ "...is " + "Paris" tokenizes as "...is" + " Paris": the choice's first token swallows the prefix's last
    one. Each choice is scored from the first token that differs from the prefix alone, as the Engine sees it."""
    prompt = SELECT_PROMPT.rstrip(" ") + " "
    tok = fp32_engine.tokenizer
    prefix = tok(prompt)["input_ids"]
    choices = [c.strip() for c in SELECT_CHOICES]
    want = []
    for c in choices:
        ids = tok(prompt + c)["input_ids"]
        k = next(i for i in range(len(prefix) + 1) if i == len(prefix) or ids[i] != prefix[i])
        assert k < len(prefix)  # the boundary really merges (else this test checks nothing new)
        out = fp32_engine.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=k
        )
        lps = [lp for lp, _t in out["meta_info"]["input_token_logprobs"] if lp is not None]
        want.append(sum(lps) / len(lps))

    @sgl.function
    def prog(s):
        s += prompt + sgl.select("city", choices=choices)

    st = prog.run(backend=backend)
    got = st.get_meta_info("city")["normalized_prompt_logprobs"]
    assert all(math.isfinite(x) for x in got)
    assert got == pytest.approx(want, abs=1e-3)
    assert st["city"] == choices[max(range(len(want)), key=lambda i: want[i])]


def test_select_greedy_token_selection(backend, fp32_engine):
    # distinct first tokens: greedy picks the choice whose first token is likeliest
    choices = [" Berlin", " Paris", " London is"]
    first = [_direct_choice_logprobs(fp32_engine, SELECT_PROMPT, c)[0] for c in choices]
    assert sorted(first)[-1] - sorted(first)[-2] > 0.01
    st = select_prog.run(choices=choices, method=sgl.greedy_token_selection, backend=backend)
    assert st["city"] in choices
    assert st["city"] == choices[max(range(len(first)), key=lambda i: first[i])]


def _direct_unconditional_logprobs(engine, choice: str) -> list[float]:
    """The logprobs of `choice`'s tokens with no prompt (its first token has none: nothing precedes it)."""
    ids = engine.tokenizer(choice, add_special_tokens=True)["input_ids"]
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    return [lp for lp, _tok in out["meta_info"]["input_token_logprobs"] if lp is not None]


def test_select_unconditional_likelihood_normalized(backend, fp32_engine):
    st = select_prog.run(choices=SELECT_CHOICES, method=sgl.unconditional_likelihood_normalized, backend=backend)
    assert st["city"] in SELECT_CHOICES
    scores = st.get_meta_info("city")["normalized_prompt_logprobs"]
    assert len(scores) == len(SELECT_CHOICES)
    assert all(math.isfinite(x) for x in scores), scores  # single-token choices too
    assert st["city"] == SELECT_CHOICES[max(range(len(scores)), key=lambda i: scores[i])]
    # SGLang's definition: the mean over the choice's tokens of (logprob given the prompt - logprob given no
    # prompt), the first token's unconditional logprob (which has no context) counting as 0
    want = []
    for c in SELECT_CHOICES:
        cond = _direct_choice_logprobs(fp32_engine, SELECT_PROMPT, c)
        uncond = _direct_unconditional_logprobs(fp32_engine, c)
        assert len(uncond) == len(cond) - 1
        want.append((sum(cond) - sum(uncond)) / len(cond))
    assert scores == pytest.approx(want, abs=1e-3)


# --- fork shares the prefix ----------------------------------------------------------------------------------
@sgl.function
def long_prefix_fork(s, prefix):
    s += prefix
    forks = s.fork(3)
    forks += "\nQuestion"  # appended to every branch
    for i, f in enumerate(forks):
        f += f" {i + 1}: what is fact {i + 3} about? Answer:" + sgl.gen("ans", max_tokens=4)
    forks.join()
    s.set_var("branches", list(forks))


def test_fork_branches_share_the_prefix(backend, fp32_engine):
    # a prefix no earlier request had (fresh nonce), so what is cached came from this program
    prefix = f"Notes {uuid.uuid4().hex}.\n" + " ".join(
        f"Fact {i}: the number {i} squared is {i * i}." for i in range(30)
    )
    n_prefix = len(fp32_engine.tokenizer(prefix, add_special_tokens=True)["input_ids"])
    assert n_prefix > 300
    st = long_prefix_fork.run(prefix=prefix, backend=backend, temperature=0)
    branches = st["branches"]
    assert len(branches) == 3 and len(st["ans"]) == 3
    for i, b in enumerate(branches):
        meta = b.get_meta_info("ans")
        assert meta["prompt_tokens"] > n_prefix
        assert n_prefix - 2 <= meta["cached_tokens"] < meta["prompt_tokens"], (i, meta)
        assert b["ans"] == st["ans"][i]
        assert b.text() == prefix + f"\nQuestion {i + 1}: what is fact {i + 3} about? Answer:" + b["ans"]


# --- run_batch equals runs one at a time ----------------------------------------------------------------------
@sgl.function
def batch_qa(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8)
    s += "\nSure: " + sgl.select("sure", choices=["yes", "no"])


def test_run_batch_of_32_gives_what_each_gives_alone(backend):
    args = [{"question": f"What is {i} plus {i % 7 + 1}?"} for i in range(16)] + [
        {"question": q}
        for q in (
            "Name a color.",
            "Name a fruit.",
            "Who wrote Hamlet?",
            "What is water?",
            "Name a planet.",
            "What do cats eat?",
            "Where is Paris?",
            "Name a river.",
            "What is 2+2?",
            "Name a bird.",
            "What is ice?",
            "Name a tree.",
            "What is the sun?",
            "Name a metal.",
            "What is a noun?",
            "Name a dog breed.",
        )
    ]
    assert len(args) == 32
    batch = batch_qa.run_batch(args, backend=backend, temperature=0, num_threads=32)
    assert len(batch) == 32
    assert all(st.error is None for st in batch)
    for kw, st in list(zip(args, batch))[::4]:  # a sample of both kinds, each run alone (sequential runs cost)
        alone = batch_qa.run(**kw, backend=backend, temperature=0)
        assert st.text() == alone.text(), kw
        assert st.variables == alone.variables, kw
        assert st.text().startswith("Q: " + kw["question"] + "\nA:")
    assert len({st["answer"] for st in batch}) > 1  # the programs really had their own arguments


# --- streaming ---------------------------------------------------------------------------------------------
@sgl.function
def story(s):
    s += sgl.user("Tell me a very short story about a cat.")
    s += sgl.assistant(sgl.gen("story", max_tokens=24))
    s += "Moral:" + sgl.gen("moral", max_tokens=6, stop="\n")


def test_stream_text_iter_joins_to_the_variables(backend):
    st = story.run(backend=backend, stream=True, temperature=0)
    pieces = list(st.text_iter("story"))
    assert len(pieces) > 1  # it streamed, not one piece at the end
    assert "".join(pieces) == st["story"]
    assert "".join(st.text_iter("moral")) == st["moral"]
    assert "".join(st.text_iter()) == st.text()
    plain = story.run(backend=backend, temperature=0)
    assert plain.variables == st.variables and plain.text() == st.text()
