"""`radixlm serve --tp-size 3` on the embedded model (9 attention heads, 3 KV heads: one KV head per rank): three
real processes in a gloo group behind one scheduler. Its OpenAI answers at temperature 0 are the unsharded
server's (the shared fp32 `server` fixture: tensor-parallel ranks dequantize the GGUF too), streamed or not,
with logprobs and a JSON schema; a client that drops its stream leaves it serving; and, last, a killed rank
ends the server non-zero within 10 s with no process left behind."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.helpers import ServerProcess, pid_alive

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tp_server():
    srv = ServerProcess("--tp-size", "3", "--max-total-tokens", "20000")
    yield srv
    if srv.proc.poll() is None:  # the last test kills one of its ranks
        srv.proc.kill()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(srv, content: str, **kw):
    return _client(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, **kw
    )


def test_answers_as_one_rank_does(tp_server, server):
    info = httpx.get(f"{tp_server.url}/get_server_info", timeout=30).json()
    assert info["scheduler"]["tp_size"] == 3 and info["server_args"]["tp_size"] == 3
    # the rank layout and each rank's memory: three processes on this host, each holding its shard (fp32
    # weights / 3 and a third of the KV heads: more than 100 MB), the unsharded server one rank holding more
    ranks = info["scheduler"]["tp_ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2] and len({r["pid"] for r in ranks}) == 3
    assert all(r["device"] == "cpu" and 100e6 < r["memory_used_bytes"] < r["memory_total_bytes"] for r in ranks)
    (whole,) = httpx.get(f"{server.url}/get_server_info", timeout=30).json()["scheduler"]["tp_ranks"]
    assert whole["rank"] == 0 and whole["memory_used_bytes"] > min(r["memory_used_bytes"] for r in ranks)
    metrics = httpx.get(f"{tp_server.url}/metrics", timeout=30).text
    for r in ranks:
        line = next(x for x in metrics.splitlines() if x.startswith("radixlm_tp_rank_memory_used_bytes{") and
                    f'rank="{r["rank"]}"' in x)  # fmt: skip
        assert f'host="{r["host"]}"' in line and float(line.split()[-1]) == r["memory_used_bytes"]
    for content in ("What is the capital of France?", "List three fruits."):
        one = _chat(server, content, max_tokens=12, logprobs=True, top_logprobs=3)
        many = _chat(tp_server, content, max_tokens=12, logprobs=True, top_logprobs=3)
        assert many.choices[0].message.content == one.choices[0].message.content
        for a, b in zip(many.choices[0].logprobs.content, one.choices[0].logprobs.content):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-3
            assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    one = _chat(server, "Weather in Paris as JSON.", max_tokens=48, response_format=rf)
    many = _chat(tp_server, "Weather in Paris as JSON.", max_tokens=48, response_format=rf)
    assert many.choices[0].message.content == one.choices[0].message.content
    assert set(json.loads(many.choices[0].message.content)) == {"city", "sunny"}


def test_stream_and_abort(tp_server):
    whole = _chat(tp_server, "Tell me about the moon.", max_tokens=12).choices[0].message.content
    stream = _chat(tp_server, "Tell me about the moon.", max_tokens=12, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    dropped = _chat(tp_server, "Count from one to one hundred.", max_tokens=64, stream=True)
    for i, _ in enumerate(dropped):
        if i == 3:
            break
    dropped.close()  # the scheduler aborts it; every rank goes on with the next batch
    again = _chat(tp_server, "Tell me about the moon.", max_tokens=12).choices[0].message.content
    assert again == whole


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def test_a_killed_rank_ends_the_server(tp_server):
    """Last in this file: it ends the module's server."""
    srv = tp_server
    everyone = _descendants(srv.proc.pid)
    workers = [p for p in everyone if p not in _children(srv.proc.pid) and _is_spawned(p)]
    assert len(workers) == 2, everyone  # ranks 1 and 2, children of the scheduler process
    os.kill(workers[0], signal.SIGKILL)
    start = time.monotonic()
    code = srv.proc.wait(timeout=10)
    assert code != 0 and time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in everyone if pid_alive(p)]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(k) for k in f.read().split()]


def _is_spawned(pid: int) -> bool:
    """A multiprocessing child (not its resource tracker)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False
