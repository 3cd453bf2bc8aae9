"""Grammar-constrained decoding through the scheduler, on every grammar backend (an engine each, from this
package's conftest): regex outputs match, constrained rows leave unconstrained ones alone, aborts and failed or
timed-out compiles free everything, and jump-forward saves forward passes."""

import concurrent.futures
import gc
import json
import re
import weakref

import jsonschema
import pytest

import radixlm
from radixlm.srt.errors import GrammarError
from tests.helpers import GRAMMAR_BACKENDS as BACKENDS
from tests.helpers import assert_engine_idle

GREEDY = {"temperature": 0}
COMPILE_TIMEOUT_S = 1  # the compile time limit of the `strict_engines` below
MAX_STEPS = 20_000  # a bound on every step loop (an idle step waits at most a few ms on the compile pool)

# (prompt, regex): every regex bounded to at most 17 characters, so 24 new tokens always reach the grammar's end.
OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
REGEX_CORPUS = [
    ("Today's date in ISO format is ", r"\d{4}-\d{2}-\d{2}"),
    ("Write an email address: ", r"[a-z]{2,6}@[a-z]{2,6}\.(com|org|net)"),
    ("The server's IP address is ", rf"({OCTET}\.){{3}}{OCTET}"),
    ("Call us at ", r"\d{3}-\d{3}-\d{4}"),
    ("My favourite pet is a ", r"(cat|dog|bird)"),
    ("A random lowercase word: ", r"[a-z]{3,8}"),
    ("The meeting starts at ", r"([01]\d|2[0-3]):[0-5]\d"),
    ("The US zip code of the White House is ", r"\d{5}(-\d{4})?"),
    ("The CSS colour of the sky is ", r"#[0-9a-fA-F]{6}"),
    ("The latest release of the library is version ", r"(0|[1-9]\d?)\.(0|[1-9]\d?)\.(0|[1-9]\d?)"),
    ("Is the sky blue? Answer: ", r"(Yes|No), [a-z]{3,8}\."),
    ("The temperature in degrees is ", r"-?\d{1,3}\.\d{2}"),
    ("The author's full name is ", r"[A-Z][a-z]{2,7} [A-Z][a-z]{2,7}"),
    ("The largest US state by population has the code ", r"(CA|NY|TX|WA|FL)"),
]
REGEX_MAX_NEW_TOKENS = 24

# Long fixed keys, consts and enums: text the grammar forces, which jump-forward appends without sampling.
JF_SCHEMA = {
    "type": "object",
    "properties": {
        "record_type_identifier": {"const": "customer_profile_version_two"},
        "is_email_address_verified": {"type": "boolean"},
        "account_lifecycle_status_code": {"enum": ["active_and_in_good_standing", "suspended_pending_review"]},
    },
    "required": ["record_type_identifier", "is_email_address_verified", "account_lifecycle_status_code"],
    "additionalProperties": False,
}
JF_PROMPTS = ["Describe the customer Alice as a JSON record: ", "Customer record for Bob in JSON: "]
JF_MAX_NEW_TOKENS = 200  # more than the longest text the schema allows has characters

SMALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "pet"],
    "additionalProperties": False,
}

# Regexes that Python's `re` accepts (so they pass the edge) and the backend cannot compile: a word boundary for
# both, plus one more unsupported feature each.
BAD_REGEXES = {
    "outlines": [(r"\bcat\b", "word boundar"), (r"^(yes|no)$", "anchored")],
    "xgrammar": [(r"\bcat\b", "word boundary"), (r"(?i)(yes|no)", "group modifier")],
    # llguidance checks its grammars without a tokenizer, so the edge refuses these before anything is queued
    "llguidance": [(r"\bcat\b", "lookarounds not supported"), (r"a\Z", "unrecognized escape sequence")],
}

# Compiles in seconds, several times COMPILE_TIMEOUT_S, and still ends by itself (measured on this 2-core CPU:
# outlines ~0.08 s per `\w?`, ~3.3 s for 40; xgrammar grows quadratically, 2 s for 50, 3.5-6 s for 60).
# llguidance builds its lexer lazily, step by step, under per-step fuel limits: no compile of it runs long.
SLOW_REGEXES = {"outlines": r"\w?" * 40, "xgrammar": r"\w?" * 60}


@pytest.fixture
def engine(engine):
    """conftest's engine of each backend, checked idle before the test uses it."""
    assert_engine_idle(engine)
    return engine


def _compiled(engine, prompts, params) -> list[dict]:
    """The answers to a warm-up whose grammars must compile first. On a loaded host a first compile can outlast
    the strict engines' limit; its request then ends with the timeout while the compile goes on and is cached,
    so the warm-up is asked again (bounded) until it is answered."""
    for _ in range(30):
        outs = engine.generate(prompts, params)
        if all(o["meta_info"]["finish_reason"]["type"] != "abort" for o in outs):
            break
    return outs


@pytest.fixture(scope="module")
def strict_engines():
    """Per backend, built on first use: jump-forward off and a short compile timeout."""
    made = {}

    def get(backend):
        if backend not in made:
            made[backend] = radixlm.Engine(
                grammar_backend=backend,
                jump_forward="off",
                grammar_compile_timeout=COMPILE_TIMEOUT_S,
                log_level="warning",
                max_total_tokens=4096,
            )
        return made[backend]

    yield get
    for e in made.values():
        e.shutdown()


def _grammar_stats(engine) -> dict:
    return dict(engine.get_stats()["grammar"])


def _forward_passes(engine) -> int:
    s = engine.get_stats()
    return s["extend_steps"] + s["decode_steps"]


def _assert_grammar_stop(engine, out):
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "stop", fr  # never "length": every grammar here ends well before max_new_tokens
    assert fr["matched"] is None or fr["matched"] in engine.loaded.config.eos_token_ids, fr


def _run_until(engine, rids, on_finish=None) -> dict:
    """Step until every request in `rids` has finished; their final updates by rid."""
    pending, done = set(rids), {}
    for _ in range(MAX_STEPS):
        if not pending:
            return done
        for item in engine.step():
            rid = item["meta_info"]["id"]
            if item["finished"] and rid in pending:
                pending.discard(rid)
                done[rid] = item
                if on_finish is not None:
                    on_finish(rid, item)
    raise AssertionError(f"requests {sorted(pending)} did not finish in {MAX_STEPS} steps")


def _run_to_idle(engine) -> list[dict]:
    updates = []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests() and not engine.scheduler.has_work():
            return updates
        updates += engine.step()
    raise AssertionError(f"the engine did not go idle in {MAX_STEPS} steps")


def _assert_failed(out, *needles, param="regex"):
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "abort" and fr["status_code"] == 400 and fr["param"] == param, fr
    for needle in needles:
        assert needle.lower() in fr["message"].lower(), fr
    assert out["output_ids"] == []


# --- 1. a corpus of regexes ---------------------------------------------------------------------------------
def test_regex_corpus_outputs_fullmatch(engine):
    assert len(REGEX_CORPUS) >= 12
    prompts, params = [], []
    for temperature in (0.7, 0):
        for prompt, regex in REGEX_CORPUS:
            prompts.append(prompt)
            params.append({"regex": regex, "temperature": temperature, "max_new_tokens": REGEX_MAX_NEW_TOKENS})
    before = _grammar_stats(engine)
    outs = engine.generate(prompts, params)
    assert len(outs) == 2 * len(REGEX_CORPUS)
    for out, p in zip(outs, params):
        assert re.fullmatch(p["regex"], out["text"]), (p, out["text"])
        _assert_grammar_stop(engine, out)
    after = _grammar_stats(engine)
    assert after["failures"] == before["failures"] and after["timeouts"] == before["timeouts"]
    assert_engine_idle(engine)


# --- 2. constrained and unconstrained requests in one batch -------------------------------------------------
def test_unconstrained_requests_unchanged_by_constrained_batchmates(engine):
    plain = ["The capital of France is", "List three colours:", "Once upon a time, in a small village,"]
    plain_sp = {**GREEDY, "max_new_tokens": 12}
    assert engine.flush_cache()
    alone = [o["output_ids"] for o in engine.generate(plain, plain_sp)]
    assert all(alone)

    constrained = [
        ("Today's date in ISO format is ", {"regex": r"\d{4}-\d{2}-\d{2}"}),
        ("My favourite pet is a ", {"regex": r"(cat|dog|bird)"}),
        ("Describe a pet owner in JSON: ", {"json_schema": SMALL_SCHEMA}),
        ("Another pet owner as JSON: ", {"json_schema": json.dumps(SMALL_SCHEMA)}),
        ("The meeting starts at ", {"regex": r"([01]\d|2[0-3]):[0-5]\d", "temperature": 0.7}),
    ]
    c_params = [{**GREEDY, "max_new_tokens": 40, **sp} for _, sp in constrained]
    # constrained requests before, between and after the unconstrained ones
    prompts = [
        constrained[0][0],
        plain[0],
        constrained[1][0],
        constrained[2][0],
        plain[1],
        plain[2],
        constrained[3][0],
        constrained[4][0],
    ]
    params = [c_params[0], plain_sp, c_params[1], c_params[2], plain_sp, plain_sp, c_params[3], c_params[4]]
    plain_at, constrained_at = [1, 4, 5], [0, 2, 3, 6, 7]
    assert engine.flush_cache()  # compute every prompt afresh, as alone
    rids = engine.add_request(prompts, params)
    shared_steps, outs = 0, {}
    for _ in range(MAX_STEPS):
        if len(outs) == len(rids):
            break
        advanced = set()
        for item in engine.step():
            i = rids.index(item["meta_info"]["id"])
            advanced.add(i)
            if item["finished"]:
                outs[i] = item
        shared_steps += bool(advanced & set(plain_at)) and bool(advanced & set(constrained_at))
    else:
        raise AssertionError(f"the batch did not finish in {MAX_STEPS} steps")
    outs = [outs[i] for i in range(len(rids))]
    assert shared_steps >= 3  # the two kinds really decoded side by side
    assert [outs[i]["output_ids"] for i in plain_at] == alone
    for i, (_, sp) in zip(constrained_at, constrained):
        _assert_grammar_stop(engine, outs[i])
        if "regex" in sp:
            assert re.fullmatch(sp["regex"], outs[i]["text"]), (sp, outs[i]["text"])
        else:
            jsonschema.validate(json.loads(outs[i]["text"]), SMALL_SCHEMA)
    assert_engine_idle(engine)


# --- 3. aborting requests in the middle of their grammar ---------------------------------------------------
def test_abort_mid_grammar_leaks_nothing(engine):
    sch = engine.scheduler
    # Decoding (with a live matcher) when aborted: grammars that force long outputs, so they are still running
    # after a few steps whatever jump-forward appends.
    words = "(alpha|beta|gamma|delta)"
    prompts = ["Count in Greek letters: ", "A list of Greek letters in JSON: ", "Write a long lowercase sentence: "]
    params = [
        {"regex": rf"{words}( {words}){{30,40}}", "max_new_tokens": 200, "temperature": 0.7},
        {
            "json_schema": {
                "type": "object",
                "properties": {"letters": {"type": "array", "minItems": 20, "items": {"enum": ["alpha", "beta"]}}},
                "required": ["letters"],
            },
            **GREEDY,
            "max_new_tokens": 200,
        },
        {"regex": r"[a-z]{3,6}( [a-z]{3,6}){20,30}\.", **GREEDY, "max_new_tokens": 200},
    ]
    # Compiled first (cached): on a busy host one slow compile would let the others run to their end meanwhile.
    engine.generate(prompts, [{**p, "max_new_tokens": 1} for p in params])
    running_rids = engine.add_request(prompts, params)
    produced = {rid: 0 for rid in running_rids}
    for _ in range(MAX_STEPS):
        if min(produced.values()) >= 3:
            break
        for item in engine.step():
            assert not item["finished"], item["meta_info"]
            produced[item["meta_info"]["id"]] = len(item["output_ids"])
    else:
        raise AssertionError(f"constrained requests did not start decoding: {produced}")
    # One more, still in the grammar queue when aborted (queued requests leave it only in step()); a fresh spec.
    queued_rid = engine.add_request(
        "My favourite pet is a ", {"regex": f"(cat|dog|bird {id(object())})", "max_new_tokens": 8}
    )[0]

    reqs = {r.rid: r for r in sch.running + sch.waiting}
    assert set(reqs) == set(running_rids)
    assert [r.rid for r, _ in sch.grammar.queue] == [queued_rid]
    assert all(reqs[rid].grammar is not None for rid in running_rids)
    matchers = [weakref.ref(reqs[rid].grammar) for rid in running_rids]
    queued_req = sch.grammar.queue[0][0]
    aborted_before = engine.get_stats()["aborted_requests"]

    for rid in running_rids + [queued_rid]:
        assert engine.abort(rid)
    assert not engine.abort(queued_rid)  # already gone
    updates = _run_to_idle(engine)
    finished = {u["meta_info"]["id"]: u for u in updates if u["finished"]}
    assert set(finished) == set(running_rids) | {queued_rid}
    for u in finished.values():
        assert u["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.get_stats()["aborted_requests"] == aborted_before + 4

    assert not sch.grammar.queue and _grammar_stats(engine)["waiting"] == 0
    assert all(r.grammar is None for r in reqs.values()) and queued_req.grammar is None
    del reqs, queued_req
    gc.collect()
    assert all(m() is None for m in matchers), "an aborted request's matcher is still referenced"
    assert_engine_idle(engine)

    # The engine goes on serving constrained requests.
    out = engine.generate("My favourite pet is a ", {"regex": r"(cat|dog|bird)", **GREEDY, "max_new_tokens": 8})
    assert re.fullmatch(r"(cat|dog|bird)", out["text"])
    assert_engine_idle(engine)


# --- 4. specs that fail to compile -------------------------------------------------------------------------
def test_compile_failure_fails_only_that_request(engine):
    backend = engine.server_args.grammar_backend
    bad = BAD_REGEXES[backend]
    for regex, _ in bad:
        re.compile(regex)  # valid for Python: the failure is the backend's
    if backend == "llguidance":
        _edge_refusals_fail_only_that_call(engine, bad)
        return
    prompts = ["My favourite pet is a "] + ["Answer: "] * len(bad) + ["The capital of France is"]
    params = (
        [{"regex": r"(cat|dog|bird)", **GREEDY, "max_new_tokens": 8}]
        + [{"regex": regex, **GREEDY, "max_new_tokens": 8} for regex, _ in bad]
        + [{**GREEDY, "max_new_tokens": 8}]
    )
    outs = engine.generate(prompts, params)
    assert re.fullmatch(r"(cat|dog|bird)", outs[0]["text"])
    _assert_grammar_stop(engine, outs[0])
    for out, (_, reason) in zip(outs[1:-1], bad):
        _assert_failed(out, "regex", "cannot be compiled", reason)
    assert outs[-1]["meta_info"]["finish_reason"]["type"] in ("stop", "length") and outs[-1]["output_ids"]
    after = _grammar_stats(engine)
    assert_engine_idle(engine)

    # A failure is cached: the same spec fails again at once, with the same message.
    again = engine.generate("Answer: ", {"regex": bad[0][0], "max_new_tokens": 8})
    _assert_failed(again, "cannot be compiled", bad[0][1])
    assert _grammar_stats(engine)["cache_hits"] > after["cache_hits"]

    # Refused at the edge (lookaround, an invalid regex): the whole call fails and nothing is enqueued.
    for regex, needle in ((r"(?=a)a", "lookaround"), (r"(cat|dog", "not a valid regular expression")):
        with pytest.raises(GrammarError, match=needle):
            engine.add_request(
                ["My favourite pet is a ", "Answer: "],
                [{"regex": r"(cat|dog|bird)", "max_new_tokens": 8}, {"regex": regex, "max_new_tokens": 8}],
            )
        assert_engine_idle(engine)
    if backend == "outlines":  # EBNF needs another backend
        with pytest.raises(GrammarError, match="--grammar-backend auto"):
            engine.generate("Answer: ", {"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 4})
    else:
        out = engine.generate("Answer: ", {"ebnf": 'root ::= "yes" | "no"', **GREEDY, "max_new_tokens": 4})
        assert out["text"] in ("yes", "no")
        bad_ebnf = engine.generate("Answer: ", {"ebnf": 'root ::= "yes" | undefined_rule', "max_new_tokens": 4})
        _assert_failed(bad_ebnf, "EBNF grammar cannot be compiled", "undefined_rule", param="ebnf")
    assert_engine_idle(engine)


def _edge_refusals_fail_only_that_call(engine, bad):
    """A backend that checks specs at the edge: a spec it cannot compile is a GrammarError (400) from the call
    that sends it, naming the problem; nothing of that call is queued, and other requests run as before."""
    for regex, reason in bad:
        with pytest.raises(GrammarError, match=reason) as info:
            engine.add_request(
                ["My favourite pet is a ", "Answer: "],
                [{"regex": r"(cat|dog|bird)", "max_new_tokens": 8}, {"regex": regex, "max_new_tokens": 8}],
            )
        assert info.value.status == 400 and info.value.param == "regex"
        assert_engine_idle(engine)
    with pytest.raises(GrammarError, match="undefined_rule") as info:
        engine.generate("Answer: ", {"ebnf": 'root ::= "yes" | undefined_rule', "max_new_tokens": 4})
    assert info.value.param == "ebnf"
    out = engine.generate("Answer: ", {"ebnf": 'root ::= "yes" | "no"', **GREEDY, "max_new_tokens": 4})
    assert out["text"] in ("yes", "no")
    out = engine.generate("My favourite pet is a ", {"regex": r"(cat|dog|bird)", **GREEDY, "max_new_tokens": 8})
    assert re.fullmatch(r"(cat|dog|bird)", out["text"])
    assert_engine_idle(engine)


# --- 5. a compile that takes too long ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", sorted(SLOW_REGEXES))
def test_slow_compile_times_out_without_stalling_others(strict_engines, backend):
    engine = strict_engines(backend)
    sch = engine.scheduler
    assert engine.server_args.grammar_compile_timeout == COMPILE_TIMEOUT_S
    # Warm up: build the backend's vocabulary index and the JSON grammar below, so that what the normal requests
    # compile takes milliseconds, far within the time limit.
    warm = _compiled(
        engine,
        ["My favourite pet is a ", "Describe a pet owner in JSON: "],
        [
            {"regex": r"(cat|dog|bird)", **GREEDY, "max_new_tokens": 8},
            {"json_schema": SMALL_SCHEMA, **GREEDY, "max_new_tokens": 40},
        ],
    )
    assert re.fullmatch(r"(cat|dog|bird)", warm[0]["text"])
    jsonschema.validate(json.loads(warm[1]["text"]), SMALL_SCHEMA)
    before = _grammar_stats(engine)

    slow_rid = engine.add_request("Type something: ", {"regex": SLOW_REGEXES[backend], "max_new_tokens": 8})[0]
    slow_future = next(t.future for r, t in sch.grammar.queue if r.rid == slow_rid)
    normal = {
        engine.add_request(
            "The meeting starts at ", {"regex": r"([01]\d|2[0-3]):[0-5]\d", **GREEDY, "max_new_tokens": 16}
        )[0]: r"([01]\d|2[0-3]):[0-5]\d",
        engine.add_request(
            "Describe a pet owner in JSON: ", {"json_schema": SMALL_SCHEMA, **GREEDY, "max_new_tokens": 40}
        )[0]: None,
        engine.add_request("The capital of France is", {**GREEDY, "max_new_tokens": 8})[0]: "",
    }
    order = []  # (rid, whether the slow compile had ended) in the order requests finished
    done = _run_until(engine, [slow_rid, *normal], lambda rid, _: order.append((rid, slow_future.done())))

    assert {rid for rid, _ in order} == {slow_rid, *normal}
    assert not any(ended for _, ended in order), f"a request finished only after the slow compile: {order}"
    for rid, regex in normal.items():
        out = done[rid]
        if regex == "":
            assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length") and out["output_ids"]
        else:
            _assert_grammar_stop(engine, out)
            if regex is None:
                jsonschema.validate(json.loads(out["text"]), SMALL_SCHEMA)
            else:
                assert re.fullmatch(regex, out["text"]), out["text"]
    _assert_failed(done[slow_rid], "took longer than", f"{COMPILE_TIMEOUT_S} s", "--grammar-compile-timeout")
    stats = _grammar_stats(engine)
    assert stats["timeouts"] == before["timeouts"] + 1 and stats["waiting"] == 0
    assert_engine_idle(engine)

    # The worker thread goes on until the compile ends; wait for it (bounded) so nothing outlives the test, and
    # the late result is not cached: a later request for that spec compiles it again.
    concurrent.futures.wait([slow_future], timeout=300)
    assert slow_future.done() and slow_future.exception() is None
    assert all(spec.spec != SLOW_REGEXES[backend] for spec in sch.grammar.manager.cache)
    assert_engine_idle(engine)


# --- 6. jump-forward ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_forward_saves_forward_passes(backend_engines, strict_engines, backend):
    on = backend_engines(backend)
    off = strict_engines(backend)
    assert on.server_args.grammar_backend == off.server_args.grammar_backend == backend
    assert on.scheduler.grammar.jump_forward and not off.scheduler.grammar.jump_forward
    sp = {"json_schema": JF_SCHEMA, **GREEDY, "max_new_tokens": JF_MAX_NEW_TOKENS}
    results = {}
    for name, engine in (("on", on), ("off", off)):
        _compiled(engine, JF_PROMPTS[:1], {**sp, "max_new_tokens": 1})  # the schema compiled (and cached) first
        assert_engine_idle(engine)
        passes, grammar = _forward_passes(engine), _grammar_stats(engine)
        outs = engine.generate(JF_PROMPTS, sp)
        for out in outs:
            _assert_grammar_stop(engine, out)
            jsonschema.validate(json.loads(out["text"]), JF_SCHEMA)
        g = _grammar_stats(engine)
        results[name] = (
            _forward_passes(engine) - passes,
            g["jump_forward_tokens"] - grammar["jump_forward_tokens"],
            g["jump_forward_events"] - grammar["jump_forward_events"],
            sum(len(o["output_ids"]) for o in outs),
        )
        assert_engine_idle(engine)
    (on_passes, on_jf_tokens, on_jf_events, on_tokens), (off_passes, off_jf_tokens, off_jf_events, _) = (
        results["on"],
        results["off"],
    )
    assert on_jf_events > 0 and on_jf_tokens >= 2 * on_jf_events  # each jump appends at least two tokens
    assert off_jf_tokens == 0 and off_jf_events == 0
    assert off.get_stats()["grammar"]["jump_forward_tokens"] == 0
    assert on_passes < off_passes, results
    # Without jump-forward each batch step adds at most one token per request; with it, a step adds many.
    assert on_passes < on_tokens / len(JF_PROMPTS), results
