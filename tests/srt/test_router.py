"""`radixlm serve --dp-size 3`: three workers of the embedded model behind the cache-aware router, real processes,
real HTTP, the real openai client; a second router (round_robin) over the same workers for comparison.

- Prefix hits: a shared-prefix workload (8 system prompts of ~150 words, 64 chat requests, 8 at a time) keeps
  its cache hits with cache_aware and loses many with round_robin, with the same greedy answers. (With 3 workers
  and 8 prompts round_robin still hits once each worker has seen a prompt: at most (64 - 24) / 64 of the
  requests, about 0.6 of the tokens.)
- Pass-through: logprobs, n > 1, streams, response_format, tools and bad input answered as the worker answers.
- Workers at run time: added and removed with the router's API key, refused without it.
- Faults: a client that hangs up is aborted at its worker; and (last: it kills a worker) no request that had
  not started streaming is lost, no stream ends silently cut, and the dead worker gets no new requests.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers import RouterProcess, ServerProcess, pid_alive

MODEL = "SmolLM2-135M-Instruct"
WORDS = "apple river stone cloud green music table window garden paper light summer yellow mountain coffee".split()


@pytest.fixture(scope="module")
def dp():
    # fp32 (the GGUF dequantized): a cached prefix and a fresh prefill then round alike, so greedy answers compare
    srv = ServerProcess("--dp-size", "3", "--quantization", "none", "--max-total-tokens", "6000", timeout=300)
    srv.workers = [w["url"] for w in httpx.get(f"{srv.url}/workers", timeout=10).json()["workers"]]
    yield srv
    srv.stop(timeout=60)


@pytest.fixture(scope="module")
def rr(dp):
    r = RouterProcess("--policy", "round_robin", "--worker-urls", *dp.workers)
    yield r
    r.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _hits(url: str) -> tuple[int, int]:
    info = httpx.get(f"{url}/get_server_info", timeout=60).json()["workers"]
    return sum(v["scheduler"]["cached_tokens"] for v in info.values()), sum(
        v["scheduler"]["prompt_tokens"] for v in info.values()
    )


def _shared_prefix_run(url: str, requests) -> tuple[float, list[str]]:
    """The prompt-token hit rate of a burst of `requests` (8 at a time) after each system prompt was sent once,
    one request at a time: every prefix is then cached on one worker before the burst, so the rate measures
    where the policy sends the burst, not which of two concurrent first requests of a group won the race."""
    assert httpx.post(f"{url}/flush_cache", timeout=60).json()["success"]
    client = _client(url)

    def one(r):
        msgs = [{"role": "system", "content": r[0]}, {"role": "user", "content": r[1]}]
        out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
        return out.choices[0].message.content

    for system in dict.fromkeys(r[0] for r in requests):
        one((system, "Warm-up: what is a cache?"))
    c0, p0 = _hits(url)
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(one, requests))
    c1, p1 = _hits(url)
    return (c1 - c0) / (p1 - p0), answers


def test_cache_aware_keeps_prefix_hits_that_round_robin_loses(dp, rr):
    rng = random.Random(0)
    systems = [f"System {g}: " + " ".join(rng.choice(WORDS) for _ in range(100)) for g in range(8)]
    requests = [(systems[rng.randrange(8)], f"Question {i}: what is {rng.choice(WORDS)}?") for i in range(32)]
    aware, aware_answers = _shared_prefix_run(dp.url, requests)
    spread, spread_answers = _shared_prefix_run(rr.url, requests)
    assert aware >= 0.7, aware
    assert aware >= spread + 0.15, (aware, spread)
    assert aware_answers == spread_answers
    state = httpx.get(f"{dp.url}/workers", timeout=10).json()
    assert state["policy"]["name"] == "cache_aware" and all(w["up"] and w["sent"] > 0 for w in state["workers"])
    metrics = httpx.get(f"{dp.url}/metrics", timeout=10).text
    assert "radixlm_router_prefix_match_bucket" in metrics and "radixlm_router_worker_up" in metrics


def test_answers_pass_through_unchanged(dp):
    """The router against one of its workers directly: the same bytes of meaning for every feature."""
    via, direct = _client(dp.url), _client(dp.workers[0])
    msgs = [{"role": "user", "content": "Name a color."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, n=2)
    a, b = via.chat.completions.create(**kw), direct.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert [t.top_logprobs[0].token for t in a.choices[0].logprobs.content] == [
        t.top_logprobs[0].token for t in b.choices[0].logprobs.content
    ]
    stream = via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == b.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"]}
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    a = via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0, response_format=rf)
    assert set(json.loads(a.choices[0].message.content)) == {"color"}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": schema}}]
    a = via.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0, tools=tools,
                                    tool_choice="required")  # fmt: skip
    assert a.choices[0].message.tool_calls[0].function.name == "paint"
    comp = via.completions.create(model=MODEL, prompt=["The sky is", "Grass is"], max_tokens=4, temperature=0)
    assert [c.text for c in comp.choices] == [
        c.text
        for c in direct.completions.create(
            model=MODEL, prompt=["The sky is", "Grass is"], max_tokens=4, temperature=0
        ).choices  # fmt: skip
    ]
    for bad in ({"model": MODEL, "messages": msgs, "max_tokens": -1}, {"model": MODEL, "messages": 5}):
        r1 = httpx.post(f"{dp.url}/v1/chat/completions", json=bad, timeout=30)
        r2 = httpx.post(f"{dp.workers[0]}/v1/chat/completions", json=bad, timeout=30)
        assert r1.status_code == r2.status_code and 400 <= r1.status_code < 500
        assert r1.json() == r2.json() and "error" in r1.json()
    assert httpx.get(f"{dp.url}/v1/models", timeout=10).json() == httpx.get(f"{dp.workers[0]}/v1/models").json()


def test_workers_added_and_removed_at_run_time(dp):
    assert httpx.post(f"{dp.url}/workers", json={"url": dp.workers[0]}, timeout=10).status_code == 403  # no key
    r = RouterProcess("--api-key", "sekret", healthy=False)
    try:
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"{r.url}/health", timeout=5).status_code == 503  # no worker yet
        assert httpx.post(f"{r.url}/workers", json={"url": dp.workers[1]}, timeout=10).status_code == 401
        assert httpx.post(f"{r.url}/workers", json={"url": "ftp://nope"}, headers=auth, timeout=10).status_code == 400
        added = httpx.post(f"{r.url}/workers", json={"url": dp.workers[1]}, headers=auth, timeout=10).json()
        assert added["up"] and httpx.get(f"{r.url}/health", timeout=5).status_code == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert httpx.post(f"{r.url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        assert httpx.post(f"{r.url}/v1/chat/completions", json=body, headers=auth, timeout=60).status_code == 200
        gone = httpx.request("DELETE", f"{r.url}/workers", json={"url": dp.workers[1]}, headers=auth, timeout=10)
        assert gone.json()["success"] and httpx.get(f"{r.url}/health", timeout=5).status_code == 503
        out = httpx.post(f"{r.url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert out.status_code == 503 and out.json()["error"]["code"] == "no_worker"
    finally:
        r.stop()


def test_a_client_that_hangs_up_is_aborted_at_the_worker(dp):
    """A whole (not streamed) answer whose client goes away: the router closes its request to the worker, which
    aborts it, instead of generating the rest for no one."""
    body = {"text": "Count:", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{dp.url}/generate", json=body, timeout=httpx.Timeout(60, read=2))

    def in_flight() -> int:
        return sum(httpx.get(f"{u}/load", timeout=10).json()["requests_in_flight"] for u in dp.workers)

    deadline = time.monotonic() + 10
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight() == 0


def test_a_killed_worker_loses_no_request_that_had_not_started(dp):
    """Last: it kills one of the module's workers. Whole answers (not streamed) are retried on another worker
    when theirs dies; a stream either ends whole or with an error event, never silently cut; the dead worker is
    marked down and later requests all succeed."""
    client = _client(dp.url)
    prompts = [f"Write a short story about the number {i}." for i in range(12)]

    def whole(p):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=16,
                                             temperature=0)  # fmt: skip
        return out.choices[0].message.content

    def streamed(p):
        try:
            s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=16,
                                               temperature=0, stream=True)  # fmt: skip
            chunks = list(s)
        except openai.APIError as e:  # the error event of a stream whose worker died
            return ("error", str(e))
        ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return ("whole" if ends == ["length"] else "cut", "".join(c.choices[0].delta.content or "" for c in chunks
                                                                 if c.choices))  # fmt: skip

    info = httpx.get(f"{dp.url}/get_server_info", timeout=30).json()["workers"]
    victim = dp.workers[2]
    pid = info[victim]["process_ids"]["http"]
    with ThreadPoolExecutor(24) as ex:
        wholes = [ex.submit(whole, p) for p in prompts]
        streams = [ex.submit(streamed, p) for p in prompts[:4]]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # kill it while it holds requests
            state = {w["url"]: w for w in httpx.get(f"{dp.url}/workers", timeout=10).json()["workers"]}
            if state[victim]["open"] >= 2:
                break
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        answers = [f.result() for f in wholes]
        stream_results = [f.result() for f in streams]
    assert all(isinstance(a, str) and a for a in answers)
    assert all(kind in ("whole", "error") for kind, _ in stream_results), stream_results
    # greedy: the retried answers are the ones a surviving worker gives
    with ThreadPoolExecutor(6) as ex:
        assert answers == list(ex.map(whole, prompts))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    state = {w["url"]: w for w in httpx.get(f"{dp.url}/workers", timeout=10).json()["workers"]}
    assert not state[victim]["up"]
    sent = state[victim]["sent"]
    assert all(whole(p) for p in prompts[:4])
    state = {w["url"]: w for w in httpx.get(f"{dp.url}/workers", timeout=10).json()["workers"]}
    assert state[victim]["sent"] == sent  # nothing new went to it
