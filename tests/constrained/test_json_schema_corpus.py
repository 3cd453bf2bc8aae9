"""The JSON-schema corpus (tests/constrained/schemas.py) through both grammar backends.

For each schema a backend supports, its output at temperature 0.7 parses and validates with `jsonschema`
(Draft 2020-12, formats checked); each schema it does not support gets a 400 naming the keyword, from the
in-process Engine and from the HTTP server (native /generate and OpenAI response_format), and leaves nothing
behind.

Formats: jsonschema checks `date`, `email` and `uuid` with the standard library alone; `date-time` needs the
`rfc3339-validator` package, which the test environment has. `test_format_checks_are_active` fails if any of the
four is not really checked, so a missing package cannot make the validation silently weaker.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import zlib

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator

from radixlm.srt.constrained.llguidance_backend import unimplemented_keys
from radixlm.srt.constrained.manager import create_backend
from radixlm.srt.constrained.spec import check_supported, grammar_spec
from radixlm.srt.errors import GrammarError
from tests.constrained.schemas import BY_NAME, CASES
from tests.helpers import GRAMMAR_BACKENDS as BACKENDS
from tests.helpers import assert_engine_idle, assert_server_idle, smollm_tokenizer

MAX_NEW_TOKENS = 384
MAX_RAMBLING = 4  # outputs allowed to run to the token limit inside an unbounded string (about 1 in 10)
MIN_SUPPORTED = 40  # each backend must accept at least this many of the corpus
FORMATS = ("date", "date-time", "email", "uuid")
MODEL = "SmolLM2-135M-Instruct"
# "'uniqueItems' at #/properties/tags is not supported by the outlines grammar backend (...)"
_REFUSAL = re.compile(r"'([^']+)' at (#[^ ]*) is not supported by the (\w+) grammar backend")


# --- helpers ---------------------------------------------------------------------------------------------------
def _validator(schema) -> Draft202012Validator:
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


def _split(backend: str):
    """(supported cases, {name: GrammarError} of the refused ones), as the backend's edge check decides."""
    supported, refused = [], {}
    for case in CASES:
        try:
            check_supported(grammar_spec(json_schema=case.schema), backend)
        except GrammarError as e:
            refused[case.name] = e
        else:
            supported.append(case)
    return supported, refused


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())  # stable per schema, whatever else the corpus holds


def _messages(case) -> list[dict]:
    return [{"role": "user", "content": f"Give me {case.description} as a JSON value. Reply with JSON only."}]


def _resolve(schema, pointer: str):
    node = schema
    for part in pointer.lstrip("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


# Keywords llguidance names in refusals that are not "Unimplemented keys: [...]"
_LLG_NAMED = ("minProperties", "maxProperties", "oneOf", "format")


def _check_refusal(case, message: str, backend: str) -> str:
    """The refusal names a keyword that the schema really has (at the place named, where the backend names one);
    returns the keyword. `auto` refuses only what no backend enforces, and says so."""
    if backend == "auto":
        assert "no grammar backend can enforce" in message, message
        backend = "xgrammar"  # its reason carries a keyword and a place; llguidance's and outlines' come beside it
    if backend == "llguidance":
        keys = unimplemented_keys(message) or [k for k in _LLG_NAMED if k in message]
        assert keys, f"{case.name}: refusal does not name a keyword: {message!r}"
        assert set(keys) <= _keywords(case.schema, set()), (case.name, keys, message)
        if case.rejects:
            assert set(keys) & set(case.rejects), f"{case.name}: expected one of {case.rejects}: {message!r}"
        return keys[0]
    m = _REFUSAL.search(message)
    assert m, f"{case.name}: refusal does not name a keyword and its place: {message!r}"
    keyword, pointer, named_backend = m.groups()
    assert named_backend == backend, message
    node = _resolve(case.schema, pointer)
    assert isinstance(node, dict) and keyword in node, (
        f"{case.name}: the refusal names {keyword!r} at {pointer}, which the schema does not have there: {message!r}"
    )
    if case.rejects:
        assert keyword in case.rejects, f"{case.name}: expected one of {case.rejects} to be named: {message!r}"
    return keyword


# --- fixtures --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


# --- the corpus itself -----------------------------------------------------------------------------------------
def _keywords(node, found: set) -> set:
    if isinstance(node, dict):
        found.update(node)
        if isinstance(node.get("format"), str):
            found.add("format:" + node["format"])
        for key, value in node.items():
            if key in ("properties", "$defs", "patternProperties", "dependentSchemas"):
                for sub in value.values():
                    _keywords(sub, found)
            elif key not in ("enum", "const", "required", "dependentRequired"):
                _keywords(value, found)
    elif isinstance(node, list):
        for sub in node:
            _keywords(sub, found)
    return found


def test_corpus_is_well_formed_and_covers_the_shapes():
    assert len(CASES) >= 40 and len(BY_NAME) == len(CASES)
    used: set = set()
    for case in CASES:
        Draft202012Validator.check_schema(case.schema)
        _keywords(case.schema, used)
    wanted = {
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "prefixItems",
        "enum",
        "const",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "$defs",
        "$ref",
        "anyOf",
        "oneOf",
        "pattern",
        "minLength",
        "maxLength",
    } | {f"format:{f}" for f in FORMATS}
    assert wanted <= used, sorted(wanted - used)
    assert sum(bool(c.rejects) for c in CASES) >= 8


def test_format_checks_are_active():
    """jsonschema only checks a format whose checker is installed; make sure all four really reject."""
    fc = Draft202012Validator.FORMAT_CHECKER
    assert set(FORMATS) <= set(fc.checkers)
    good = {
        "date": "2024-02-29",
        "date-time": "2024-02-29T10:20:30Z",
        "email": "ada@example.com",
        "uuid": "123e4567-e89b-12d3-a456-426614174000",
    }
    bad = {
        "date": "2023-02-29",
        "date-time": "2024-02-29 10:20:30",
        "email": "ada.example.com",
        "uuid": "123e4567e89b12d3a456426614174000",
    }
    for f in FORMATS:
        v = _validator({"type": "string", "format": f})
        assert v.is_valid(good[f]), f
        assert not v.is_valid(bad[f]), f
    assert not _validator({"type": "string", "format": "date-time"}).is_valid("2024-02-29T10:20:30")  # no offset


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_each_backend_supports_most_of_the_corpus(backend):
    supported, refused = _split(backend)
    assert len(supported) >= MIN_SUPPORTED, sorted(refused)
    # what a backend does not enforce it refuses: outlines and xgrammar drop every `rejects` keyword; llguidance
    # enforces three of them (tested below) and refuses the rest
    enforced = LLGUIDANCE_ENFORCES if backend in ("llguidance", "auto") else {}
    assert {c.name for c in CASES if c.rejects} - set(enforced) <= set(refused)
    assert not set(enforced) & set(refused)
    if backend == "auto":  # auto accepts what any backend enforces
        assert {c.name for c in supported} == set().union(*({c.name for c in _split(b)[0]} for b in BACKENDS))


# llguidance's keyword coverage beyond the other engines: a schema each, with instances it must refuse
LLGUIDANCE_ENFORCES = {
    "env_vars": ('{"HOME": "/root", "PATH": "/bin"}', ['{"home": "/root"}', '{"HOME": 3}']),
    "bounded_pattern": ('{"code": "AB12"}', ['{"code": "ABCDEFG"}', '{"code": "ab"}']),
    "decimal_price": ('{"price": 12.34}', ['{"price": 12.345}']),
}


def test_llguidance_enforces_the_keywords_it_accepts():
    """Each keyword llguidance accepts beyond the other engines is enforced: the grammar walks a valid instance
    to its end and refuses a token of each invalid one."""
    tok = smollm_tokenizer()
    backend = create_backend("llguidance", tok, len(tok), [2])
    for name, (good, bads) in LLGUIDANCE_ENFORCES.items():
        compiled = backend.compile(grammar_spec(json_schema=BY_NAME[name].schema))
        _validator(BY_NAME[name].schema).validate(json.loads(good))
        m = compiled.matcher()
        assert all(m.accept(t) for t in tok.encode(good, add_special_tokens=False)) and m.is_terminated(), name
        for bad in bads:
            assert not _validator(BY_NAME[name].schema).is_valid(json.loads(bad))
            m = compiled.matcher()
            assert not all(m.accept(t) for t in tok.encode(bad, add_special_tokens=False)), (name, bad)


# --- the Engine: supported schemas validate, unsupported ones get a 400 --------------------------------------
def test_supported_schemas_generate_valid_json(engine):
    """A third of the corpus per backend, the thirds interleaved (schema i goes to backend i % 3): each backend
    is checked on schemas of every kind, every schema by one backend, and CI pays for one corpus of generation
    instead of three."""
    backend = engine.server_args.grammar_backend
    supported, _ = _split(backend)
    assert len(supported) >= MIN_SUPPORTED
    third = BACKENDS.index(backend)
    supported = [c for c in supported if CASES.index(c) % 3 == third]
    if backend == "outlines":  # auto's last resort, and the slowest to compile: every other one of its third
        supported = supported[::2]
    params = [
        {"json_schema": c.schema, "temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS, "seed": _seed(c.name)}
        for c in supported
    ]
    outs = engine.generate(input_ids=[engine.chat_ids(_messages(c)) for c in supported], sampling_params=params)
    assert len(outs) == len(supported)
    failures, rambled = [], []
    for case, out in zip(supported, outs):
        meta, text = out["meta_info"], out["text"]
        reason = meta["finish_reason"]
        if reason.get("type") == "length":
            # An unbounded string (an email's local part, free text) lets a 135M model at temperature 0.7 go on
            # until the token limit; the grammar allowed every token, so it is the model's failure, not ours.
            # A few are tolerated (counted below). Such an output must be unfinished: had it closed the value, the
            # grammar would have ended it with `stop`.
            try:
                json.loads(text)
            except json.JSONDecodeError:
                rambled.append(case.name)
            else:
                failures.append(f"{case.name}: a complete value was not ended by the grammar: {text!r}")
            continue
        if reason.get("type") != "stop" or meta["completion_tokens"] >= MAX_NEW_TOKENS:
            failures.append(
                f"{case.name}: finished with {reason} after {meta['completion_tokens']} tokens: {text[:200]!r}"
            )
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            failures.append(f"{case.name}: not JSON ({e}): {text!r}")
            continue
        errors = [
            f"{'/'.join(map(str, err.absolute_path))}: {err.message}"
            for err in _validator(case.schema).iter_errors(value)
        ]
        if errors:
            failures.append(f"{case.name}: {text!r} does not validate: {errors}")
    assert not failures, f"{backend}: {len(failures)} of {len(supported)} outputs failed:\n" + "\n".join(failures)
    assert len(rambled) <= MAX_RAMBLING, f"{backend}: {len(rambled)} outputs ran to the token limit: {rambled}"
    assert_engine_idle(engine)


def test_unsupported_schemas_get_400_naming_the_keyword(engine):
    backend = engine.server_args.grammar_backend
    _, refused = _split(backend)
    assert refused
    good = {"json_schema": BY_NAME["traffic_light"].schema, "max_new_tokens": 16}
    named = set()
    for name in refused:
        case = BY_NAME[name]
        sp = {"json_schema": case.schema, "temperature": 0.7, "max_new_tokens": MAX_NEW_TOKENS}
        with pytest.raises(GrammarError) as info:
            engine.generate(input_ids=engine.chat_ids(_messages(case)), sampling_params=sp)
        err = info.value
        assert err.status == 400 and err.type == "invalid_request_error" and err.param == "json_schema"
        named.add(_check_refusal(case, err.message, backend))
        # the JSON text form is refused the same way, and so is a batch holding it: none of the batch runs
        with pytest.raises(GrammarError) as info:
            engine.generate(["Say hi.", "JSON please:"], [good, {**sp, "json_schema": json.dumps(case.schema)}])
        assert info.value.message == err.message
    if backend == "outlines":
        assert {"minimum", "exclusiveMinimum"} <= named  # numeric bounds it would not enforce
    assert {"uniqueItems", "not", "dependentRequired", "contains"} <= named
    assert ("if" in named or "else" in named) and ("patternProperties" in named) == (backend != "llguidance")
    assert_engine_idle(engine)


# --- the HTTP server (default backend: auto) ----------------------------------------------------------------
def test_http_response_format_output_validates(server, client):
    cases = [BY_NAME[n] for n in ("calendar_event", "shape", "permissions")]

    def ask(case):
        return client.chat.completions.create(
            model=MODEL,
            messages=_messages(case),
            temperature=0.7,
            max_tokens=MAX_NEW_TOKENS,
            seed=_seed(case.name),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
            },
        )

    with cf.ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(ask, cases))
    for case, r in zip(cases, replies):
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and r.usage.completion_tokens < MAX_NEW_TOKENS, (case.name, choice)
        value = json.loads(choice.message.content)
        errors = [e.message for e in _validator(case.schema).iter_errors(value)]
        assert not errors, (case.name, choice.message.content, errors)
    assert_server_idle(server.url)


def test_http_unsupported_schemas_get_400_naming_the_keyword(server, client):
    backend = httpx.get(f"{server.url}/get_server_info", timeout=30).json()["server_args"]["grammar_backend"]
    assert backend == "auto"
    _, refused = _split(backend)
    assert refused
    chat_params = {}
    for name in refused:
        case = BY_NAME[name]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL,
                messages=_messages(case),
                temperature=0.7,
                max_tokens=MAX_NEW_TOKENS,
                response_format={"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}},
            )
        assert info.value.status_code == 400
        body = info.value.response.json()
        assert set(body) == {"error"}, body
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["code"] is not None, error
        _check_refusal(case, error["message"], backend)
        chat_params[case.name] = error["param"]

        r = httpx.post(
            f"{server.url}/generate",
            timeout=60,
            json={"text": "JSON please:", "sampling_params": {"json_schema": case.schema, "max_new_tokens": 32}},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "json_schema", error
        _check_refusal(case, error["message"], backend)
    assert_server_idle(server.url)
    # the OpenAI contract: a bad response_format is a 400 whose `param` names that request field
    wrong = {name: p for name, p in chat_params.items() if p != "response_format"}
    assert not wrong, f"chat completions named the wrong param for response_format errors: {wrong}"
