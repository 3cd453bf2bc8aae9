"""Structured output at the server's edges: what it refuses with a 400 (and keeps serving), and what it
reports in /metrics about grammars."""

import json
import re
import time

import httpx

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "score": {"enum": [1, 2, 3]}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def _generate(server, params, text="Reply in JSON: ", timeout=120):
    return httpx.post(f"{server.url}/generate", json={"text": text, "sampling_params": params}, timeout=timeout)


def _error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _nested_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def test_refusals_leave_the_server_serving(server):
    # a body nested past the JSON parser's depth
    body = ('{"text": "x", "sampling_params": {"stop": ' + "[" * 5000 + "]" * 5000 + "}}").encode()
    resp = httpx.post(f"{server.url}/generate", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code in (400, 422), resp.text
    assert "error" in resp.json()
    # a schema nested deeper than any grammar backend handles, given as an object and as text
    msg = _error(_generate(server, {"json_schema": _nested_schema(200), "max_new_tokens": 4}), 400, "json_schema")
    assert "deeper than" in msg
    msg = _error(
        _generate(server, {"json_schema": json.dumps(_nested_schema(40)), "max_new_tokens": 4}), 400, "json_schema"
    )
    assert "deeper than" in msg
    # EBNF is served by the default backend (auto); one that refers to a rule it never defines is a 400 naming it
    msg = _error(_generate(server, {"ebnf": 'root ::= "yes" | nowhere', "max_new_tokens": 4}), 400, "ebnf")
    assert "nowhere" in msg
    resp = _generate(server, {"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 4, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["text"] in ("yes", "no"), resp.text
    _error(_generate(server, {"regex": "(unclosed", "max_new_tokens": 4}), 400, "regex")
    _error(_generate(server, {"regex": "a+", "json_schema": SCHEMA}), 400)
    # the same through the OpenAI route: a response_format whose schema is not an object
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}},
        },
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    # and a constrained request right after all that is served, valid
    resp = _generate(server, {"json_schema": SCHEMA, "max_new_tokens": 64, "temperature": 0})
    assert resp.status_code == 200, resp.text
    out = json.loads(resp.json()["text"])
    assert set(out) == {"answer", "score"} and out["score"] in (1, 2, 3) and len(out["answer"]) <= 12


def test_grammar_metrics(server):
    before = httpx.get(f"{server.url}/metrics").text
    hits0 = _metric(before, "radixlm_grammar_cache_hits_total")
    count0 = _metric(before, "radixlm_grammar_compile_seconds_count")
    # a schema this server has not seen (compiles), then the same one again (a cache hit)
    schema = {
        "type": "object",
        "properties": {"metric_probe": {"enum": ["on", "off"]}},
        "required": ["metric_probe"],
        "additionalProperties": False,
    }
    for _ in range(2):
        resp = _generate(server, {"json_schema": schema, "max_new_tokens": 32, "temperature": 0})
        assert resp.status_code == 200 and json.loads(resp.json()["text"])["metric_probe"] in ("on", "off")
    after = httpx.get(f"{server.url}/metrics").text
    assert _metric(after, "radixlm_grammar_compile_seconds_count") == count0 + 1
    assert _metric(after, "radixlm_grammar_cache_hits_total") == hits0 + 1
    assert _metric(after, "radixlm_grammar_compiles_total") >= 1
    assert _metric(after, "radixlm_grammar_compile_seconds_sum") > 0
    assert _metric(after, "radixlm_grammar_waiting_reqs") == 0
    # `{"metric_probe": "` is forced text: jump-forward appended it without sampling
    assert _metric(after, "radixlm_jump_forward_tokens_total") > 0
    inf_bucket = re.search(r'^radixlm_grammar_compile_seconds_bucket{le="\+Inf"[^}]*} ([0-9.]+)$', after, re.M)
    assert inf_bucket and float(inf_bucket.group(1)) == count0 + 1


def test_a_repeated_schema_moves_backend_and_stays_valid(server):
    """auto serves a new JSON schema with llguidance and, once outlines has built its index in the background,
    later requests for it with outlines (AutoBackend.promotion): every answer before and after is valid, and the
    move shows in /metrics."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    promotions0 = _metric(httpx.get(f"{server.url}/metrics").text, "radixlm_grammar_promotions_total")
    answers = []
    deadline = time.monotonic() + 90
    while True:
        resp = _generate(server, {"json_schema": schema, "max_new_tokens": 40, "temperature": 0})
        assert resp.status_code == 200, resp.text
        out = json.loads(resp.json()["text"])
        assert set(out) == {"city", "rank"} and len(out["city"]) <= 10 and isinstance(out["rank"], int), out
        answers.append(out)
        promoted = _metric(httpx.get(f"{server.url}/metrics").text, "radixlm_grammar_promotions_total") - promotions0
        if promoted >= 1 and len(answers) >= 3:
            break
        assert time.monotonic() < deadline, f"no promotion after {len(answers)} requests"
    assert promoted == 1
