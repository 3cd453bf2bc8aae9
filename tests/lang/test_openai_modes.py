"""radixlm's `OpenAI` backend on the server's /v1 routes, in the modes SGLang's own tests drive it: a completion
model (the program's text as the prompt, select by prompt logprobs), a chat model continuing a partly written
assistant turn, and API speculative execution on a chat model. At temperature 0 each must give what the native
backend gives for the same prompt (conftest.py: the server, its RuntimeEndpoint and MODEL_NAME).
"""

from __future__ import annotations

import pytest

import radixlm as sgl
from tests.lang.conftest import MODEL_NAME


@pytest.fixture(scope="module")
def completion_backend(server):
    be = sgl.OpenAI(MODEL_NAME, is_chat_model=False, base_url=f"{server.url}/v1", api_key="none")
    yield be
    be.shutdown()


@sgl.function
def few_shot(s, question):
    s += "Q: What is the capital of France?\nA: Paris\nQ: What is the capital of Italy?\nA: Rome\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, stop="\n")
    s += "\nConfident: " + sgl.select("sure", ["yes", "no", "somewhat"])
    s += "\n1 + 1 = 2\n2 + 2 = 4\n3 + 3 = " + sgl.gen_int("six", max_tokens=6)
    s += "\nCounting: one, two, three," + sgl.gen("count", max_tokens=24, stop_regex=r"\bsix\b")


def test_completion_model_runs_what_the_native_backend_runs(completion_backend, http_backend):
    assert not completion_backend.is_chat_model and completion_backend.get_model_name() == MODEL_NAME
    completion_backend.token_usage.reset()
    remote = few_shot.run(question="What is the capital of Germany?", backend=completion_backend, temperature=0)
    native = few_shot.run(question="What is the capital of Germany?", backend=http_backend, temperature=0)
    assert remote.text() == native.text()
    assert remote.variables == native.variables
    assert remote["six"] == "6"  # the dtype's regex reached /v1/completions
    assert "six" not in remote["count"] and " four" in remote["count"]
    got, want = remote.get_meta_info("sure"), native.get_meta_info("sure")
    assert got["select_method"] == "prompt_logprobs"  # scored like the native backend, not asked for an answer
    assert got["normalized_prompt_logprobs"] == pytest.approx(want["normalized_prompt_logprobs"], abs=2e-3)
    usage = completion_backend.token_usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens >= len(remote["answer"].split())


def test_completion_model_streams_and_samples(completion_backend):
    @sgl.function
    def prog(s):
        s += "A story about a cat:" + sgl.gen("story", max_tokens=16)
        s += "\nTwo names:" + sgl.gen("names", max_tokens=3, n=2, temperature=1.0, seed=1)

    st = prog.run(backend=completion_backend, stream=True, temperature=0)
    pieces = list(st.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == st["story"]
    assert isinstance(st["names"], list) and len(st["names"]) == 2
    assert st.text().endswith("\nTwo names:" + st["names"][0])


@sgl.function
def continued_turn(s):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant_begin()
    s += "The capital of France is" + sgl.gen("city", max_tokens=6, stop=".")
    s += sgl.assistant_end()


def test_chat_model_continues_a_partly_written_assistant_turn(openai_backend, http_backend):
    assert openai_backend.is_chat_model
    remote = continued_turn.run(backend=openai_backend, temperature=0)
    native = continued_turn.run(backend=http_backend, temperature=0)
    assert remote["city"] and remote["city"] == native["city"]
    assert remote.messages()[-1] == {"role": "assistant", "content": "The capital of France is" + remote["city"]}


def _reply(spec_tokens):
    @sgl.function(num_api_spec_tokens=spec_tokens)
    def reply(s):
        s += sgl.user("Repeat after me: Name: Ada\nJob: cook")
        s += sgl.assistant(sgl.gen("first", max_tokens=8, stop=",") + "," + sgl.gen("second", max_tokens=8, stop=","))

    return reply


def test_chat_speculation_generates_a_turn_in_one_request(openai_backend):
    openai_backend.token_usage.reset()
    plain = _reply(None).run(backend=openai_backend, temperature=0)
    plain_usage = openai_backend.token_usage.prompt_tokens
    openai_backend.token_usage.reset()
    spec = _reply(48).run(backend=openai_backend, temperature=0)
    assert spec.get_meta_info("first")["speculative"] and spec.get_meta_info("second")["speculative"]
    assert spec["first"] and spec.variables == plain.variables and spec.messages() == plain.messages()
    assert spec.messages()[-1]["content"] == spec["first"] + "," + spec["second"]
    # one request for the turn, where piece by piece took two
    assert openai_backend.token_usage.prompt_tokens == spec.get_meta_info("first")["prompt_tokens"] < plain_usage


def _card(spec_tokens):
    @sgl.function(num_api_spec_tokens=spec_tokens)
    def card(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("Describe Ada Lovelace.")
        s += sgl.assistant(
            "Employee record #4471, first field:"
            + sgl.gen("name", max_tokens=8, stop="\n")
            + "\nJob:"
            + sgl.gen("job", max_tokens=8, stop="\n")
        )

    return card


def test_chat_speculation_that_does_not_fit_runs_piece_by_piece(openai_backend):
    # the model never writes this label, so its answer cannot fill the turn: the turn is generated gen by gen,
    # continuing the partial turn, exactly as without speculation
    spec = _card(48).run(backend=openai_backend, temperature=0)
    plain = _card(None).run(backend=openai_backend, temperature=0)
    assert "speculative" not in spec.get_meta_info("name")
    assert spec.variables == plain.variables and spec.messages() == plain.messages()
    assert spec.messages()[-1]["content"].startswith("Employee record #4471, first field:")
