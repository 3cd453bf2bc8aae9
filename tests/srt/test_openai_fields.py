"""No request field is silently ignored on the OpenAI routes (and /generate): every field of openai-python's
request types is classified, OpenAI fields we do not implement are accepted when they cannot change the answer,
and the bodies popular clients send keep working. The 400s (unknown fields, unimplemented ones that would change
the answer, misplaced ones) are test_openai_refusals.py's.

The client bodies below were captured from the clients themselves (langchain-openai 1.7.4, llama-index-llms-openai
0.8.3, openai 2.54, each pointed at a server that records what it receives): chat, streaming, tools with a
follow-up turn, and structured output, sent here as raw JSON so the clients need not be installed. The field
lists themselves live in srt/entrypoints/openai/protocol.py."""

import copy
import json

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from radixlm.srt.entrypoints.openai import protocol

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
OK = {"model": MODEL, "messages": ASK, "max_tokens": 2}


# --- classification against openai-python's own request types (no server) -----------------------------------
def test_every_openai_chat_field_is_classified():
    """Each field of OpenAI's chat request is declared (implemented, ignored or refused): a field a new client
    version adds must be classified here, not fall to the unknown-field 400 by accident."""
    ours = protocol.ChatCompletionRequest.model_fields
    theirs = set(chat_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert theirs - set(ours) == set(), "classify these in protocol.py"
    assert set(protocol.REFUSED) <= theirs and set(protocol.IGNORED) <= theirs
    assert not set(protocol.REFUSED) & set(protocol.IGNORED)


def test_every_openai_completions_field_is_classified():
    theirs = set(completion_params.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert theirs - set(protocol.CompletionRequest.model_fields) == set()


def test_every_openai_message_and_part_key_is_known():
    from openai.types.chat import chat_completion_assistant_message_param as assistant
    from openai.types.chat import chat_completion_content_part_refusal_param as refusal
    from openai.types.chat import chat_completion_content_part_text_param as text
    from openai.types.chat import chat_completion_developer_message_param as developer
    from openai.types.chat import chat_completion_function_tool_param as function_tool
    from openai.types.chat import chat_completion_message_function_tool_call_param as call
    from openai.types.chat import chat_completion_stream_options_param as stream_options
    from openai.types.chat import chat_completion_system_message_param as system
    from openai.types.chat import chat_completion_tool_message_param as tool
    from openai.types.chat import chat_completion_user_message_param as user
    from openai.types.shared_params import function_definition, response_format_json_schema

    keys = lambda t: set(t.__annotations__)  # noqa: E731
    message_keys = set(protocol.ChatMessage.model_fields)
    for t in (
        system.ChatCompletionSystemMessageParam,
        developer.ChatCompletionDeveloperMessageParam,
        user.ChatCompletionUserMessageParam,
        assistant.ChatCompletionAssistantMessageParam,
        tool.ChatCompletionToolMessageParam,
    ):
        assert keys(t) <= message_keys, t
    assert keys(text.ChatCompletionContentPartTextParam) <= protocol._PART_KEYS["text"]
    assert keys(refusal.ChatCompletionContentPartRefusalParam) <= protocol._PART_KEYS["refusal"]
    assert keys(stream_options.ChatCompletionStreamOptionsParam) <= set(protocol.StreamOptions.model_fields)
    # the key sets protocol.py checks these dicts against
    assert keys(function_tool.ChatCompletionFunctionToolParam) <= {"type", "function"}
    assert keys(function_definition.FunctionDefinition) <= {"name", "description", "parameters", "strict"}
    assert keys(call.ChatCompletionMessageFunctionToolCallParam) <= {"id", "type", "function"}
    assert keys(response_format_json_schema.JSONSchema) <= {"name", "description", "schema", "strict"}


# --- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=300)


def error_of(r: httpx.Response, code: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    return err


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        events.append(json.loads(line[6:]))
        assert "error" not in events[-1], events[-1]
    return events


# Bodies as the clients sent them (only `model` set to ours; LlamaIndex's OpenAI class insists on an OpenAI model
# name, which this server answers with a 404, so LlamaIndex users name the served model through OpenAILike).
# Strings and numbers bounded, so that a forced call or a schema answer always fits its tokens (this small model
# will otherwise write digits until it runs out).
CITY = {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}
WEATHER_LC = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {"properties": {"city": CITY}, "required": ["city"], "type": "object"},
    },
}
WEATHER_LI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "get_weather(city: str) -> str\nGet the weather in a city.",
        "parameters": {
            "properties": {"city": {"title": "City", **CITY}},
            "required": ["city"],
            "type": "object",
            "additionalProperties": False,
        },
        "strict": False,
    },
}
CITY_SCHEMA = {
    "description": "A city.",
    "properties": {
        "city": {"description": "name", "title": "City", **CITY},
        "population": {"title": "Population", "type": "integer", "minimum": 0, "maximum": 10**8},
    },
    "required": ["city", "population"],
    "title": "City",
    "type": "object",
    "additionalProperties": False,
}
JSON_SCHEMA_RF = {"type": "json_schema", "json_schema": {"schema": CITY_SCHEMA, "name": "City", "strict": True}}
TOOL_HISTORY = [
    {"content": "Weather in Paris?", "role": "user"},
    {
        "content": None,
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"content": "sunny", "role": "tool", "tool_call_id": "call_1"},
]

CLIENT_BODIES = {
    "langchain invoke": {
        "messages": [{"content": "Be brief.", "role": "system"}, {"content": "Capital of France?", "role": "user"}],
        "max_completion_tokens": 8,
        "stream": False,
        "temperature": 0.0,
    },
    "langchain options": {
        "messages": [{"content": "hi", "role": "user"}],
        "frequency_penalty": 0.1,
        "logprobs": True,
        "max_completion_tokens": 4,
        "n": 1,
        "presence_penalty": 0.1,
        "seed": 1,
        "stop": ["\n"],
        "stream": False,
        "top_logprobs": 2,
        "top_p": 0.9,
    },
    "langchain tool turn": {
        "messages": TOOL_HISTORY,
        "max_completion_tokens": 8,
        "stream": False,
        "temperature": 0.0,
        "tools": [WEATHER_LC],
    },
    "langchain forced tool": {
        "messages": [{"content": "Weather in Paris?", "role": "user"}],
        "max_completion_tokens": 200,
        "parallel_tool_calls": False,
        "stream": False,
        "temperature": 0.0,
        "tool_choice": "required",
        "tools": [WEATHER_LC],
    },
    "langchain structured (function_calling)": {
        "messages": [{"content": "Paris", "role": "user"}],
        "max_completion_tokens": 200,
        "parallel_tool_calls": False,
        "stream": False,
        "temperature": 0.0,
        "tool_choice": {"type": "function", "function": {"name": "City"}},
        "tools": [
            {"type": "function", "function": {"name": "City", "description": "A city.", "parameters": CITY_SCHEMA}}
        ],
    },
    "langchain structured (json_schema)": {
        "messages": [{"content": "Paris", "role": "user"}],
        "max_completion_tokens": 200,
        "response_format": JSON_SCHEMA_RF,
        "stream": False,
        "temperature": 0.0,
    },
    "langchain structured (json_mode)": {
        "messages": [{"content": "Paris as JSON", "role": "user"}],
        "max_completion_tokens": 8,
        "response_format": {"type": "json_object"},
        "stream": False,
        "temperature": 0.0,
    },
    "llamaindex chat with tools": {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 8,
        "parallel_tool_calls": False,
        "stream": False,
        "temperature": 0.0,
        "tool_choice": "auto",
        "tools": [WEATHER_LI],
    },
    "llamaindex tool turn": {
        "messages": TOOL_HISTORY,
        "max_tokens": 8,
        "parallel_tool_calls": False,
        "stream": False,
        "temperature": 0.0,
        "tool_choice": "auto",
        "tools": [{**WEATHER_LI, "function": {**WEATHER_LI["function"], "strict": True}}],
    },
    "llamaindex logprobs": {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "stream": False,
        "temperature": 0.1,
        "top_logprobs": 2,
        "max_tokens": 4,
    },
    "openai parse (tool)": {
        "messages": [{"role": "user", "content": "Paris"}],
        "stream": False,
        "max_tokens": 8,
        "tools": [
            {
                "type": "function",
                "function": {"name": "City", "strict": True, "parameters": CITY_SCHEMA, "description": "A city."},
            }
        ],
    },
}


@pytest.mark.parametrize("name", list(CLIENT_BODIES))
def test_client_bodies_answer(url, name):
    body = {"model": MODEL, **copy.deepcopy(CLIENT_BODIES[name])}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if body.get("tool_choice") not in (None, "auto"):  # a forced call: whole, with the schema's arguments
        assert choice["finish_reason"] == "tool_calls", choice
        args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert set(args) == set(body["tools"][0]["function"]["parameters"]["required"])
    elif (body.get("response_format") or {}).get("type") == "json_schema":
        assert set(json.loads(choice["message"]["content"])) == {"city", "population"}
    else:
        assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    if body.get("logprobs"):
        assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])


def test_client_streams(url):
    """LangChain's stream (stream_usage on), the openai client's, and LlamaIndex's (no stream_options)."""
    for extra in ({"stream_options": {"include_usage": True}}, {}):
        body = {
            "model": MODEL,
            "messages": ASK,
            "max_completion_tokens": 6,
            "stream": True,
            "temperature": 0.0,
            **extra,
        }
        events = stream_events(url, "/v1/chat/completions", body)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert ("usage" in events[-1]) == bool(extra)
    # LangChain's completion model: prompt as a list, nulls and neutral values for what it does not set
    body = {
        "model": MODEL,
        "prompt": ["The capital of France is"],
        "frequency_penalty": 0,
        "logprobs": None,
        "max_tokens": 4,
        "n": 1,
        "presence_penalty": 0,
        "seed": None,
        "temperature": 0.0,
        "top_p": 1,
    }
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    events = stream_events(url, "/v1/completions", {**body, "prompt": body["prompt"][0], "stream": True})
    assert "".join(c["text"] for e in events for c in e["choices"]) == r.json()["choices"][0]["text"]


def test_ignorable_fields_do_not_change_the_answer(client):
    """OpenAI's bookkeeping, billing and cache-hint fields are accepted and the greedy answer is the same."""
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
    base = client.chat.completions.create(**kw).choices[0].message.content
    ignored = dict(
        user="u-1",
        metadata={"run": "7"},
        store=True,
        service_tier="flex",
        safety_identifier="h",
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        modalities=["text"],
        reasoning_effort="none",
        n=None,
        logprobs=None,
    )
    got = client.chat.completions.create(
        **kw, **ignored, extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}
    )
    assert got.choices[0].message.content == base
    streamed = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == base
    text = client.completions.create(model=MODEL, prompt="Hello, my name is", temperature=0, max_tokens=6)
    again = client.completions.create(
        model=MODEL, prompt="Hello, my name is", temperature=0, max_tokens=6, user="u-1", echo=None
    )
    assert again.choices[0].text == text.choices[0].text


def test_history_fields_are_rendered(url):
    """An earlier refusal (OpenAI returns it beside a null content) is what the assistant said, and counts in the
    prompt; a refusal part the same; `name` and a text part's cache breakpoint are accepted."""
    said = "I cannot help with that."

    def prompt_tokens(assistant: dict, **user) -> int:
        msgs = [
            {"role": "user", "content": "Tell me a secret.", **user},
            {"role": "assistant", **assistant},
            {"role": "user", "content": "Why not?"},
        ]
        r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens({"content": said})
    assert prompt_tokens({"content": None, "refusal": said}) == plain
    assert prompt_tokens({"content": [{"type": "refusal", "refusal": said}]}) == plain
    assert prompt_tokens({"content": ""}) < plain
    assert (
        prompt_tokens(
            {"content": [{"type": "text", "text": said, "prompt_cache_breakpoint": {"mode": "explicit"}}]}, name="ann"
        )
        == plain
    )


def test_generate_return_text_in_logprobs(url):
    """SGLang's return_text_in_logprobs on /generate: every (logprob, id) entry carries the token's text."""
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 0,
    }
    plain = post(url, "/generate", body).json()
    r = post(url, "/generate", {**body, "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    out, meta = r.json(), r.json()["meta_info"]
    assert out["text"] == plain["text"]
    assert [e[1] for e in meta["output_token_logprobs"]] == [e[1] for e in plain["meta_info"]["output_token_logprobs"]]
    assert "".join(e[2] for e in meta["output_token_logprobs"]) == out["text"]
    assert all(len(e) == 3 for e in meta["input_token_logprobs"])
    assert all(len(t) == 3 and isinstance(t[2], str) for top in meta["output_top_logprobs"] for t in top)
