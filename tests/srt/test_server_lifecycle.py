"""Server edges: bad input (while a generation streams on), auth, overload, metrics, shutdown, child death."""

import glob
import json
import threading
import time

import httpx
import pytest

from tests.helpers import ServerProcess, pid_alive

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def _error(r, status, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def test_bad_inputs_leave_a_running_stream_unharmed(server):
    url = server.url
    result = {}

    def long_stream():
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": CHAT,
            "max_tokens": 80,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        text, finish = "", None
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    for c in chunk["choices"]:
                        text += c["delta"].get("content") or ""
                        finish = c["finish_reason"] or finish
        result.update(text=text, finish=finish)

    t = threading.Thread(target=long_stream)
    t.start()
    chat = f"{url}/v1/chat/completions"
    comp = f"{url}/v1/completions"
    ok = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"content-type": "application/json"}
    _error(httpx.post(chat, content=b'{"messages": [', headers=headers), 422, "malformed_json")
    _error(httpx.post(chat, json={**ok, "messages": "hi"}), 400)
    assert _error(httpx.post(chat, json={**ok, "max_tokens": "ten"}), 400)["param"] == "max_tokens"
    assert _error(httpx.post(chat, json={**ok, "temperature": "hot"}), 400)["param"] == "temperature"
    assert _error(httpx.post(chat, json={**ok, "no_such_field": 1}), 400)["param"] == "no_such_field"  # never ignored
    assert _error(httpx.post(chat, json={**ok, "max_tokens": -1}), 400)["param"] == "max_tokens"
    _error(httpx.post(chat, json={**ok, "max_tokens": 10**9}), 400, "context_length_exceeded")
    _error(httpx.post(comp, json={"prompt": "word " * 9000, "max_tokens": 4}), 400, "context_length_exceeded")
    assert _error(httpx.post(chat, json={**ok, "temperature": -1}), 400)["param"] == "temperature"
    assert _error(httpx.post(chat, json={**ok, "top_p": 0}), 400)["param"] == "top_p"
    assert _error(httpx.post(chat, json={**ok, "top_p": 1.5}), 400)["param"] == "top_p"
    assert _error(httpx.post(chat, json={**ok, "n": 0}), 400)["param"] == "n"
    assert _error(httpx.post(chat, json={**ok, "logit_bias": {"5": 500}}), 400)["param"] == "logit_bias"
    assert _error(httpx.post(comp, json={"prompt": "hi", "logit_bias": {"99999999": 1}}), 400)["param"] == "logit_bias"
    assert _error(httpx.post(chat, json={**ok, "messages": []}), 400)["param"] == "messages"
    _error(httpx.post(chat, json={**ok, "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    _error(
        httpx.post(chat, content=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', headers=headers),
        400,
        "invalid_encoding",
    )
    lone = b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    assert "surrogate" in _error(httpx.post(chat, content=lone, headers=headers), 400)["message"]
    assert "surrogate" in _error(httpx.post(comp, content=b'{"prompt": "\\udfff"}', headers=headers), 400)["message"]
    big = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
    _error(httpx.post(comp, content=big, headers=headers, timeout=60), 413, "request_too_large")
    _error(httpx.post(chat, json={**ok, "model": "gpt-4"}), 404, "model_not_found")
    _error(httpx.get(f"{url}/v1/nothing-here"), 404)
    _error(httpx.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"temprature": 0.1}}), 400)
    _error(httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 10**9]}), 400)
    _error(httpx.post(f"{url}/generate", json={"text": ""}), 400)
    t.join(timeout=300)
    assert result["finish"] == "length" and len(result["text"]) > 60
    reference = httpx.post(
        chat,
        json={
            "model": "SmolLM2-135M-Instruct",
            "messages": CHAT,
            "max_tokens": 80,
            "ignore_eos": True,
            "temperature": 0,
        },
        timeout=300,
    ).json()
    assert result["text"] == reference["choices"][0]["message"]["content"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics(server):
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "radixlm_time_to_first_token_seconds_bucket",
        "radixlm_inter_token_latency_seconds_bucket",
        "radixlm_e2e_request_latency_seconds_count",
        "radixlm_generation_tokens_total",
        "radixlm_cache_hit_rate",
        "radixlm_num_running_reqs",
        "radixlm_num_waiting_reqs",
        "radixlm_kv_cache_usage_ratio",
        "radixlm_http_requests_total",
    ):
        assert name in text, name
    gen = [line for line in text.splitlines() if line.startswith("radixlm_generation_tokens_total{")]
    assert float(gen[0].split()[-1]) >= 3


@pytest.fixture(scope="module")
def guarded():
    srv = ServerProcess("--api-key", "sekret", "--max-queued-requests", "2", "--max-total-tokens", "8192")
    yield srv
    assert srv.stop() == 0


def test_api_key(guarded):
    url = guarded.url
    assert httpx.get(f"{url}/health").status_code == 200  # the one open route
    _error(httpx.get(f"{url}/v1/models"), 401, "invalid_api_key")
    _error(httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer wrong"}), 401, "invalid_api_key")
    _error(httpx.get(f"{url}/metrics"), 401)
    assert httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer sekret"}).status_code == 200


def test_overloaded_answers_503(guarded):
    auth = {"authorization": "Bearer sekret"}
    body = {"prompt": "Count:", "max_tokens": 100, "ignore_eos": True}  # long enough to hold both slots
    threads = [
        threading.Thread(
            target=httpx.post,
            args=(f"{guarded.url}/v1/completions",),
            kwargs={"json": body, "headers": auth, "timeout": 300},
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{guarded.url}/get_server_info", headers=auth).json()["requests_in_flight"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _error(httpx.post(f"{guarded.url}/v1/completions", json=body, headers=auth), 503, "overloaded")
    for t in threads:
        t.join()
    assert (
        httpx.post(
            f"{guarded.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth, timeout=60
        ).status_code
        == 200
    )


def test_sigterm_shuts_down_cleanly():
    import os
    import shutil
    import tempfile

    # a temporary folder of this server's own (short: socket paths are limited to 107 bytes): the other worker's
    # servers make and remove their sockets' folders in /tmp meanwhile
    tmp = tempfile.mkdtemp(prefix="rl-")
    try:
        cpu = max(os.sched_getaffinity(0))
        srv = ServerProcess("--max-total-tokens", "4096", "--scheduler-cpus", str(cpu), env={"TMPDIR": tmp})
        pids = httpx.get(f"{srv.url}/get_server_info").json()["process_ids"]
        assert os.sched_getaffinity(pids["scheduler"]) == {cpu}  # pinned as asked; the others left alone
        assert os.sched_getaffinity(pids["detokenizer"]) == os.sched_getaffinity(0)
        # the detokenizer was sent the server's tokenizer, pickled: it never loads torch (seconds of start-up)
        with open(f"/proc/{pids['detokenizer']}/maps") as f:
            assert "libtorch" not in f.read()
        assert len(glob.glob(f"{tmp}/radixlm-ipc-*")) == 1
        start = time.monotonic()
        assert srv.stop(timeout=20) == 0
        assert time.monotonic() - start < 10
        assert not any(pid_alive(p) for p in pids.values())
        assert glob.glob(f"{tmp}/radixlm-ipc-*") == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_killed_scheduler_makes_server_exit_nonzero():
    import os
    import signal

    srv = ServerProcess("--max-total-tokens", "4096")
    pids = httpx.get(f"{srv.url}/get_server_info").json()["process_ids"]
    os.kill(pids["scheduler"], signal.SIGKILL)
    start = time.monotonic()
    saw_unhealthy = False
    while srv.proc.poll() is None and time.monotonic() - start < 15:
        try:
            saw_unhealthy |= httpx.get(f"{srv.url}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert srv.proc.poll() is not None and time.monotonic() - start < 10
    assert srv.proc.returncode != 0
    assert saw_unhealthy
    time.sleep(0.5)
    assert not pid_alive(pids["detokenizer"])


def test_a_tokenizer_that_does_not_load_fails_the_start_cleanly(tmp_path):
    """A --tokenizer-path with nothing loadable: the server exits 1 saying so, and its children (the
    detokenizer waits for the server's tokenizer; the scheduler loads its own) are gone with it."""
    import subprocess
    import sys

    from radixlm.srt.utils import kill_on_parent_death
    from tests.helpers import free_port, group_alive

    (tmp_path / "tokenizer_config.json").write_text("{}")
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(free_port()), "--tokenizer-path", str(tmp_path)]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=kill_on_parent_death
    )
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-2000:]
    assert f"cannot load the tokenizer from {tmp_path}" in err, err[-2000:]
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_alive(proc.pid) == []


def test_free_local_port_is_outside_the_ephemeral_range():
    """Ports picked for servers, workers and rendezvous lie below the kernel's ephemeral range (which a group's
    own sockets draw from while the server starts) and are free when picked."""
    import socket

    from radixlm._net import free_local_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        first = int(f.read().split()[0])
    ports = {free_local_port() for _ in range(20)}
    assert len(ports) > 1 and all(20000 <= p < first for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
