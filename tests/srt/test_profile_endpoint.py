"""POST /start_profile and /stop_profile (SGLang's endpoints) on a launched server: the steps between them are
recorded by torch.profiler in the scheduler process and written as a Chrome trace and a summary table; bad
arguments and out-of-order calls are 400s with an OpenAI-shaped body, and the server goes on answering."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import httpx
import openai
import pytest


@pytest.fixture(autouse=True)
def _no_profile_left(server):
    """The server is shared with other test files: a test that fails midway leaves no profile running."""
    yield
    httpx.post(f"{server.url}/stop_profile", timeout=300)


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


def _chat(server, n: int = 4) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=n,
        temperature=0,
    )
    return out.choices[0].message.content


def _check_files(info: dict) -> None:
    with gzip.open(info["trace"], "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    summary = open(info["summary"]).read()
    assert "aten::" in summary and "Self CPU" in summary


def test_profile_between_start_and_stop(server, tmp_path):
    url = server.url
    _error(httpx.post(f"{url}/stop_profile", timeout=30))  # nothing running
    out = tmp_path / "prof"
    r = httpx.post(f"{url}/start_profile", json={"output_dir": str(out)}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["output_dir"] == str(out) and r.json()["activities"] == ["CPU"]
    assert "already running" in _error(httpx.post(f"{url}/start_profile", json={}, timeout=30))["message"]
    answer = _chat(server)
    r = httpx.post(f"{url}/stop_profile", timeout=300)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["steps"] >= 4  # the request's prefill and decode steps
    assert info["trace"].startswith(str(out)) and info["summary"].startswith(str(out))
    _check_files(info)
    _error(httpx.post(f"{url}/stop_profile", timeout=30))  # stopped: nothing to stop now
    assert _chat(server) == answer  # profiling changed nothing the client sees


def test_profile_of_a_number_of_steps_stops_itself(server, tmp_path):
    url = server.url
    r = httpx.post(f"{url}/start_profile", json={"output_dir": str(tmp_path), "num_steps": 2}, timeout=30)
    assert r.status_code == 200, r.text
    _chat(server, n=8)  # a prefill and seven decode steps: the profile ended after two of them
    # it stopped itself: stop_profile says where it wrote the profile
    r = httpx.post(f"{url}/stop_profile", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["steps"] == 2  # not the eight the request ran: the profile had ended
    _check_files(r.json())
    _error(httpx.post(f"{url}/stop_profile", timeout=30))


def test_bad_profile_requests_are_refused_and_start_nothing(server, tmp_path):
    url = server.url
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = [
        ({"num_steps": 0}, "num_steps"),
        ({"activities": []}, "activities"),
        ({"activities": ["TPU"]}, "TPU"),
        ({"activities": ["GPU"]}, "CUDA"),  # this server runs on the CPU
        ({"output_dir": str(blocker / "sub")}, "cannot be created"),
        ({"with_stack": True}, "with_stack"),  # not a field: refused, never silently ignored
    ]
    for body, word in bad:
        err = _error(httpx.post(f"{url}/start_profile", json=body, timeout=30))
        assert word in err["message"] + str(err.get("param")), (body, err)
    _error(httpx.post(f"{url}/stop_profile", timeout=30))  # none of them started a profile
    assert _chat(server)


def test_engine_profiles_the_steps_it_runs(smol_engine, tmp_path):
    """The in-process Engine's start_profile / stop_profile, as the endpoints."""
    from radixlm.srt.diagnostics.profiler import ProfileError

    with pytest.raises(ProfileError, match="no profile is running"):
        smol_engine.stop_profile()
    smol_engine.start_profile(output_dir=str(tmp_path), num_steps=3)
    try:
        with pytest.raises(ProfileError, match="already running"):
            smol_engine.start_profile(output_dir=str(tmp_path))
        smol_engine.generate("The capital of France is", {"max_new_tokens": 6, "temperature": 0})
    finally:
        info = smol_engine.stop_profile()
    assert info["steps"] == 3
    _check_files(info)


def test_empty_and_chunked_bodies_are_read_and_a_failed_write_is_reported(server, tmp_path):
    url = server.url
    # no body at all: every argument defaults (output_dir from RADIXLM_TORCH_PROFILER_DIR, else /tmp)
    r = httpx.post(f"{url}/start_profile", timeout=30)
    assert r.status_code == 200, r.text
    info = httpx.post(f"{url}/stop_profile", timeout=300).json()
    for key in ("trace", "summary"):
        os.remove(info[key])

    # a chunked body (no content-length) is read and checked like any other: never taken for an empty one
    def chunks():
        yield b'{"num_steps": 0, '
        yield b'"with_stack": true}'

    _error(httpx.post(f"{url}/start_profile", content=chunks(), timeout=30))
    _error(httpx.post(f"{url}/stop_profile", timeout=30))  # nothing started

    # a profile that ends itself and cannot be written: the stop says why, the server goes on
    out = tmp_path / "gone"
    r = httpx.post(f"{url}/start_profile", json={"output_dir": str(out), "num_steps": 1}, timeout=30)
    assert r.status_code == 200, r.text
    shutil.rmtree(out)
    answer = _chat(server)
    assert "could not be written" in _error(httpx.post(f"{url}/stop_profile", timeout=60))["message"]
    assert _chat(server) == answer
