"""Backends for the frontend-language tests: the in-process Engine (EngineBackend over the session's fp32 SmolLM2
engine), the launched server (RuntimeEndpoint, also fp32) and its /v1 (OpenAI), and a way to set the default
backend. fp32 on both sides: these tests check the language's semantics by exact agreement between a program's
results and the same requests sent directly, in other batch shapes; with the packed Q4 path's bf16 activations
a different batch shape can flip a near-tie (tests/srt covers that path)."""

from __future__ import annotations

import pytest

import radixlm as sgl
from radixlm.lang.global_config import global_config

MODEL_NAME = "SmolLM2-135M-Instruct"


# --- backends ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_backend(fp32_engine):
    be = sgl.EngineBackend(fp32_engine)
    yield be
    be.shutdown()
    assert not be.driver.thread.is_alive()
    # The backend did not own the engine: it still serves, and is left idle and clean for other tests.
    assert not fp32_engine.has_unfinished_requests()
    out = fp32_engine.generate("Hello", {"max_new_tokens": 1, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 1
    assert fp32_engine.flush_cache()


@pytest.fixture(scope="module")
def http_backend(server):
    be = sgl.RuntimeEndpoint(server.url)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def openai_backend(server):
    be = sgl.OpenAI(MODEL_NAME, base_url=f"{server.url}/v1", api_key="none")
    yield be
    be.shutdown()


@pytest.fixture(params=["engine", "http"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture
def default_backend():
    """Programs run with no backend= (as SGLang's docs write them); the previous default is restored after."""
    before = global_config.default_backend
    yield sgl.set_default_backend
    global_config.default_backend = before
