"""SGLang's frontend API as programs written for it call it (issue 28): gen's arguments and positional order,
dtype / gen_int / gen_string, n, stop_regex, logprob options, var_scope, item assignment, `forks += lambda`,
run()/run_batch() keywords, global_config, flush_cache, get_server_info, token_usage and API speculative
execution. Our own programs, on the embedded SmolLM2 (backends: conftest.py).
"""

from __future__ import annotations

import inspect
import re
import threading
import time
import uuid

import pytest

import radixlm as sgl
from radixlm.lang.backend.base import Backend
from radixlm.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, resolve_dtype
from radixlm.lang.speculative import Term, split_turn

# SGLang's order (python/sglang/lang/api.py): a program that passes these positionally must mean the same here
SGLANG_GEN_ORDER = [
    "name",
    "max_tokens",
    "min_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "dtype",
    "choices",
    "choices_method",
    "regex",
    "json_schema",
]
SGLANG_GEN_INT_ORDER = [
    "name",
    "max_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
]


def _positional(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]


# --- the API's shape (no model) -------------------------------------------------------------------------------
def test_gen_takes_sglang_positional_order_and_extras_only_by_keyword():
    assert _positional(sgl.gen) == SGLANG_GEN_ORDER
    assert _positional(sgl.gen_int) == SGLANG_GEN_INT_ORDER
    assert _positional(sgl.gen_string) == SGLANG_GEN_INT_ORDER
    g = sgl.gen("x", 64, 16)  # max_tokens=64, min_tokens=16 (it was stop=16 before)
    assert (g.max_tokens, g.min_tokens, g.stop) == (64, 16, None)
    assert sgl.gen("x", 8, None, 3, "\n").sampling_params() == {"max_new_tokens": 8, "n": 3, "stop": "\n"}
    assert sgl.gen("x", repetition_penalty=1.1, seed=7).sampling_params() == {"repetition_penalty": 1.1, "seed": 7}
    with pytest.raises(TypeError, match="bogus"):
        sgl.gen("x", bogus=1)


def test_regex_constants_are_sglangs_and_dtype_maps_to_them():
    assert REGEX_INT == r"[-+]?[0-9]+[ \n]*"
    assert REGEX_FLOAT == r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
    assert REGEX_BOOL == r"(True|False)"
    assert REGEX_STR == r"\"[\w\d\s]*\""
    # int and float end at the first space or newline; the gen's own stop strings are kept
    assert resolve_dtype({"dtype": int, "stop": "."}) == {"regex": REGEX_INT, "stop": [".", " ", "\n"]}
    assert resolve_dtype({"dtype": "float"}) == {"regex": REGEX_FLOAT, "stop": [" ", "\n"]}
    assert resolve_dtype({"dtype": str}) == {"regex": REGEX_STR}
    assert resolve_dtype({"dtype": bool}) == {"regex": REGEX_BOOL}
    assert sgl.gen_int("n").dtype is int and sgl.gen_string("s").dtype is str
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype({"dtype": list})


def test_unknown_run_keyword_is_a_clear_type_error_before_the_program_runs():
    ran = []

    @sgl.function
    def prog(s, question, context="none"):
        ran.append(1)

    with pytest.raises(TypeError) as e:
        prog.run(question="q", temprature=0)  # misspelled: neither a run() option nor an argument
    msg = str(e.value)
    assert "'temprature'" in msg and "prog(question, context='none')" in msg
    with pytest.raises(TypeError, match=r"question.*prog\(question"):
        prog.run()  # a missing argument, named with the signature
    with pytest.raises(TypeError, match="'topic'"):
        prog.run_batch([{"question": "a"}, {"topic": "b"}])  # the whole batch is checked first
    with pytest.raises(TypeError, match="'bogus'"):
        prog.bind(bogus=1)
    assert ran == []


def test_split_turn_reads_each_term_from_one_answer():
    terms = [
        Term(text="Name:"),
        Term(gen=sgl.gen("name"), params={"stop": "\n"}),
        Term(text="\nJob:"),
        Term(gen=sgl.gen("job"), params={"stop": ["\n"]}),
    ]
    assert split_turn("Name: Ada\nJob: engineer\nmore", terms) == ["Name:", " Ada", "\nJob:", " engineer"]
    assert split_turn("Name: Ada", terms) is None  # the second fixed text never comes
    assert split_turn("Title: Ada\nJob: x", terms) is None  # the first does not match
    # a gen with no stop ends where the next fixed text begins
    terms[1] = Term(gen=sgl.gen("name"), params={})
    assert split_turn("Name: Ada\nJob: cook", terms) == ["Name:", " Ada", "\nJob:", " cook"]


# --- gen arguments, on both native backends -------------------------------------------------------------------
def test_gen_positional_min_tokens_holds_off_the_end(backend):
    @sgl.function
    def prog(s):
        # gen(name, max_tokens, min_tokens, n, stop): the second holds off its stop for 10 tokens
        s += "Q: What color is the sky?\nA: The sky is" + sgl.gen("free", 16, None, None, ".") + ".\n"
        s += "Q: What color is grass?\nA: Grass is" + sgl.gen("held", 16, 10, None, ".")

    st = prog.run(backend=backend, temperature=0)
    assert st.get_meta_info("free")["completion_tokens"] < 10  # the model reaches the stop early by itself
    assert st.get_meta_info("held")["completion_tokens"] >= 10


def test_gen_int_and_dtypes_hold_to_their_patterns(backend):
    @sgl.function
    def prog(s):
        s += "2 + 2 = 4\n3 + 3 = 6\n5 + 5 = " + sgl.gen_int("ten", max_tokens=8) + "\n"
        s += "pi = " + sgl.gen("pi", dtype=float, max_tokens=8) + "\n"
        s += "Is water wet? " + sgl.gen("wet", dtype=bool) + "\n"
        s += "name = " + sgl.gen("name", dtype=str, max_tokens=12)

    st = prog.run(backend=backend, temperature=0)
    assert st["ten"] == "10"  # ends at the newline (a stop string), which the value does not keep
    assert st.get_meta_info("ten")["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", st["pi"]), st["pi"]
    assert st["wet"] in ("True", "False")
    assert re.fullmatch(r"\"[\w\d\s]*\"?", st["name"]), st["name"]
    assert st.text().startswith("2 + 2 = 4\n3 + 3 = 6\n5 + 5 = 10\npi = " + st["pi"] + "\n")


def test_gen_n_gives_every_sample_and_the_first_joins_the_text(backend):
    @sgl.function
    def prog(s):
        s += "A random fruit:" + sgl.gen("fruit", max_tokens=4, n=3, temperature=1.0, seed=3)
        s += "|"

    st = prog.run(backend=backend)
    fruits, metas = st["fruit"], st.get_meta_info("fruit")
    assert isinstance(fruits, list) and len(fruits) == 3 and len(metas) == 3
    assert all(m["completion_tokens"] >= 1 for m in metas)
    assert len(set(fruits)) > 1  # three samples, not one three times
    assert st.text() == "A random fruit:" + fruits[0] + "|"


def test_stop_regex_cuts_the_text_and_ends_the_request(backend, fp32_engine):
    @sgl.function
    def prog(s, pattern):
        s += "Counting: one, two, three," + sgl.gen("count", max_tokens=48, stop_regex=pattern)
        s += "|"

    st = prog.run(pattern=r"\bsix\b", backend=backend, temperature=0)
    assert " four" in st["count"] and "six" not in st["count"], st["count"]
    assert st.get_meta_info("count")["finish_reason"] == {"type": "stop", "matched": "six"}
    assert st.text() == "Counting: one, two, three," + st["count"] + "|"
    # a list of patterns: the earliest match wins
    st2 = prog.run(pattern=[r"\bsix\b", r"f[a-z]+,"], backend=backend, temperature=0)
    assert st2["count"] == " "  # cut before "four,"
    if isinstance(backend, sgl.EngineBackend):  # the request the match closed was aborted, not left running
        deadline = time.monotonic() + 30
        while (backend.driver.aborted or fp32_engine.has_unfinished_requests()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not backend.driver.aborted and not fp32_engine.has_unfinished_requests()


def test_logprob_options_from_gen_and_from_run(backend):
    @sgl.function
    def prog(s):
        s += "The capital of France is" + sgl.gen(
            "a", max_tokens=3, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
        )
        s += "." + sgl.gen("b", max_tokens=2)

    st = prog.run(backend=backend, temperature=0)
    meta = st.get_meta_info("a")
    out = meta["output_token_logprobs"]
    assert len(out) == 3 and all(len(e) == 3 for e in out)
    assert "".join(e[2] for e in out) == st["a"]  # each entry carries its token's text
    assert all(len(top) == 2 and top[0][2] == e[2] for top, e in zip(meta["output_top_logprobs"], out))
    assert "output_token_logprobs" not in st.get_meta_info("b")
    # run()'s options are every gen's defaults; logprob_start_len=0 scores the whole prompt
    st = prog.run(backend=backend, temperature=0, return_logprob=True, logprob_start_len=0)
    meta_b = st.get_meta_info("b")
    assert len(meta_b["output_token_logprobs"]) == 2
    assert len(meta_b["input_token_logprobs"]) == meta_b["prompt_tokens"]


# --- the state --------------------------------------------------------------------------------------------------
def test_var_scope_item_assignment_and_contains(backend):
    @sgl.function
    def prog(s):
        s += "Start. "
        with s.var_scope("block"):
            s += "Q: 1 + 1 = " + sgl.gen("sum", max_tokens=2, stop="\n") + "."
        s["shout"] = s["sum"].upper() + "!"
        s += " After."

    st = prog.run(backend=backend, temperature=0)
    assert st["block"] == "Q: 1 + 1 = " + st["sum"] + "." and st["sum"]
    assert st.text() == "Start. " + st["block"] + " After."
    assert st["shout"] == st["sum"].upper() + "!"
    assert "block" in st and "missing" not in st
    st["note"] = 3
    assert st["note"] == 3


def test_forks_take_one_item_per_branch(engine_backend):
    contexts = ["Ethan is tall.", "Noah is short.", "Oliver is fast."]

    @sgl.function
    def prog(s):
        s += "Statements:\n"
        forks = s.fork(3)
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        again = s.fork(2)
        again += [" A", " B"]  # a list: one item per branch
        again += sgl.gen("word", max_tokens=2)  # anything else: the same item on every branch
        again.join()
        s += "Done."

    st = prog.run(backend=engine_backend, temperature=0)
    assert st.text() == "Statements:\n" + "".join(f"Statement {i}: {c}\n" for i, c in enumerate(contexts)) + "Done."
    assert isinstance(st["word"], list) and len(st["word"]) == 2

    @sgl.function
    def bad(s):
        s += "x"
        forks = s.fork(2)
        forks += ["only one"]

    with pytest.raises(sgl.LangError, match="one item per branch"):
        bad.run(backend=engine_backend)


def test_copy_joins_its_variables_back(engine_backend):
    @sgl.function
    def prog(s):
        s += "Colors: red, green,"
        with s.copy() as c:
            c += sgl.gen("next", max_tokens=2)
        s += " end"

    st = prog.run(backend=engine_backend, temperature=0)
    assert isinstance(st["next"], list) and len(st["next"]) == 1
    assert st.text() == "Colors: red, green, end"


# --- run() and run_batch() keywords ---------------------------------------------------------------------------
class _ThreadRecorder(Backend):
    """The engine backend, noting which thread made each generation request."""

    def __init__(self, inner):
        self.inner, self.threads = inner, []

    def role_markers(self):
        return self.inner.role_markers()

    def generate(self, call):
        self.threads.append(threading.get_ident())
        return self.inner.generate(call)


def test_use_thread_false_runs_items_in_the_callers_thread(engine_backend):
    @sgl.function
    def prog(s):
        s += "Hello," + sgl.gen("a", max_tokens=2)

    rec = _ThreadRecorder(engine_backend)
    inline = prog.run(backend=rec, temperature=0, use_thread=False)
    threaded = prog.run(backend=rec, temperature=0)
    assert rec.threads[0] == threading.get_ident() != rec.threads[1]
    assert inline.text() == threaded.text()


def test_run_batch_generator_style_and_tuple_arguments(backend):
    @sgl.function
    def prog(s, a, b="?"):
        s += f"{a} + {b} =" + sgl.gen("sum", max_tokens=3)

    gen = prog.run_batch([(1, 2), (3,), {"a": 5, "b": 6}], backend=backend, temperature=0, generator_style=True)
    assert inspect.isgenerator(gen)
    states = list(gen)
    assert [st.text().split(" =")[0] for st in states] == ["1 + 2", "3 + ?", "5 + 6"]
    listed = prog.run_batch([(1, 2), (3,), {"a": 5, "b": 6}], backend=backend, temperature=0)
    assert [st.text() for st in listed] == [st.text() for st in states]
    with pytest.raises(TypeError, match="3 values"):
        prog.run_batch([(1, 2, 3)], backend=backend)


# --- global_config, server calls, token usage -------------------------------------------------------------------
def test_global_config_default_backend_and_server_calls(default_backend, backend, fp32_engine):
    default_backend(backend)
    assert sgl.global_config.default_backend is backend and sgl.get_default_backend() is backend
    name = backend.get_model_name()
    assert name.endswith(".gguf") and "SmolLM2" in name
    info = sgl.get_server_info()
    assert "server_args" in info and "scheduler" in info

    @sgl.function
    def prog(s, nonce):
        s += f"Note {nonce}: " + "the quick brown fox jumps over the lazy dog. " * 8 + sgl.gen("x", max_tokens=1)

    nonce = uuid.uuid4().hex
    backend.token_usage.reset()
    first = prog.run(nonce=nonce, temperature=0)
    meta = first.get_meta_info("x")
    assert (backend.token_usage.prompt_tokens, backend.token_usage.completion_tokens) == (
        meta["prompt_tokens"],
        meta["completion_tokens"],
    )
    assert prog.run(nonce=nonce, temperature=0).get_meta_info("x")["cached_tokens"] >= meta["prompt_tokens"] - 2
    assert sgl.flush_cache() is True
    assert prog.run(nonce=nonce, temperature=0).get_meta_info("x")["cached_tokens"] == 0  # really flushed


def test_global_config_takes_an_engine(default_backend, fp32_engine):
    default_backend(None)
    assert sgl.flush_cache() is False and sgl.get_server_info() is None  # no backend: SGLang's answers
    sgl.global_config.default_backend = fp32_engine
    be = sgl.global_config.default_backend
    try:
        assert isinstance(be, sgl.EngineBackend) and be.engine is fp32_engine
    finally:
        be.shutdown()


# --- API speculative execution on a completion API --------------------------------------------------------------
def _count_prog(spec_tokens):
    @sgl.function(num_api_spec_tokens=spec_tokens)
    def prog(s):
        s += "Count: 1, 2, 3," + sgl.gen("a", max_tokens=8, stop=",") + "," + sgl.gen("b", max_tokens=8, stop=",")
        s += ", and so on."

    return prog


def test_speculation_serves_later_gens_from_one_request(engine_backend):
    engine_backend.token_usage.reset()
    plain = _count_prog(None).run(backend=engine_backend, temperature=0)
    plain_usage = engine_backend.token_usage.prompt_tokens
    engine_backend.token_usage.reset()
    spec = _count_prog(16).run(backend=engine_backend, temperature=0)
    spec_usage = engine_backend.token_usage.prompt_tokens
    assert (plain["a"], plain["b"]) == (spec["a"], spec["b"]) == (" 4", " 5")
    assert spec.text() == plain.text() == "Count: 1, 2, 3, 4, 5, and so on."
    assert spec.get_meta_info("a")["completion_tokens"] == 16  # asked for num_api_spec_tokens, no stop
    assert spec.get_meta_info("b") == {"speculative": True}  # no request of its own
    assert spec_usage == spec.get_meta_info("a")["prompt_tokens"] < plain_usage  # one request, not two
