"""The other half of "no request field is silently ignored" (test_openai_fields.py has the classification and
the bodies clients send): an unknown field is a 400 naming it, at every level of the body; an OpenAI field this
server does not implement, one that would change the answer, is a 400 too; a field OpenAI has, sent where OpenAI
does not read it, is refused as well; none of these disturbs a stream running beside them."""

import concurrent.futures as cf

import pytest

from tests.helpers import assert_server_idle
from tests.srt.test_openai_fields import (
    ASK,
    CITY_SCHEMA,
    MODEL,
    OK,
    TOOL_HISTORY,
    WEATHER_LC,
    error_of,
    post,
    stream_events,
)

# (route, body, the field the 400 must name)
UNKNOWN = [
    ("/v1/chat/completions", {**OK, "max_token": 5}, "max_token"),
    ("/v1/chat/completions", {**OK, "extra_body": {"top_k": 1}}, "extra_body"),
    ("/v1/chat/completions", {**OK, "guided_jsn": {"type": "object"}}, "guided_jsn"),  # a misspelt constraint
    ("/v1/chat/completions", {**OK, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {**OK, "stream": True, "regx": "a+"}, "regx"),
    (
        "/v1/chat/completions",
        {**OK, "messages": [{"role": "user", "content": "hi", "reasoning_content": ""}]},
        "messages[0].reasoning_content",
    ),
    (
        "/v1/chat/completions",
        {
            **OK,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
            ],
        },
        "messages[0].content[0].cache_control",
    ),
    (
        "/v1/chat/completions",
        {
            **OK,
            "messages": TOOL_HISTORY[:1]
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "index": 0, "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ],
        },
        "messages[1].tool_calls[0].index",
    ),
    (
        "/v1/chat/completions",
        {**OK, "tools": [{"type": "function", "function": {**WEATHER_LC["function"], "parallel": True}}]},
        "tools[0].function.parallel",
    ),
    (
        "/v1/chat/completions",
        {**OK, "tools": [WEATHER_LC], "tool_choice": {"type": "function", "name": "get_weather"}},
        "tool_choice.name",
    ),
    (
        "/v1/chat/completions",
        {**OK, "response_format": {"type": "json_schema", "schema": CITY_SCHEMA}},
        "response_format.schema",
    ),
    (
        "/v1/chat/completions",
        {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "json_schema": CITY_SCHEMA}}},
        "response_format.json_schema.json_schema",
    ),
    (
        "/v1/chat/completions",
        {**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "messages": ASK}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "guided_regexp": "a"}, "guided_regexp"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "image_data": "x.png"}, "image_data"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "max_tokens": 2}}, "max_tokens"),
]
# OpenAI fields we do not implement, which would change the answer
REFUSED = [
    ("/v1/chat/completions", {**OK, "prediction": {"type": "content", "content": "Paris"}}, "prediction"),
    ("/v1/chat/completions", {**OK, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {**OK, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {**OK, "functions": [WEATHER_LC["function"]]}, "functions"),
    ("/v1/chat/completions", {**OK, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {**OK, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {**OK, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {**OK, "verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {**OK, "moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("/v1/chat/completions", {**OK, "stream": True, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    (
        "/v1/chat/completions",
        {**OK, "messages": ASK + [{"role": "assistant", "audio": {"id": "audio_1"}}]},
        "messages[1].audio",
    ),
    (
        "/v1/chat/completions",
        {
            **OK,
            "messages": ASK
            + [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
        },
        "messages[1].function_call",
    ),
    (
        "/v1/chat/completions",
        {
            **OK,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}
            ],
        },
        "messages[0].content[0]",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "suffix": "!"}, "suffix"),
]


@pytest.mark.parametrize("path,body,param", UNKNOWN, ids=[p for _, _, p in UNKNOWN])
def test_unknown_fields_are_named(url, path, body, param):
    sampling_key = path == "/generate" and param in body["sampling_params"]  # SamplingParams' own error
    err = error_of(post(url, path, body), "invalid_value" if sampling_key else "unknown_parameter")
    assert err["param"] == param and param in err["message"], err


@pytest.mark.parametrize("path,body,param", REFUSED, ids=[p for _, _, p in REFUSED])
def test_unimplemented_openai_fields_are_refused(url, path, body, param):
    err = error_of(post(url, path, body), "unsupported_parameter")
    assert err["param"] == param and err["message"].startswith(f"{param} is not supported"), err


def test_misplaced_fields_are_refused(url):
    """Fields OpenAI has, sent where it does not read them, are not dropped either."""
    cases = [
        ({**OK, "messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
        ({**OK, "messages": [{"role": "user", "content": "hi", "refusal": "no"}]}, "messages[0].refusal"),
        (
            {**OK, "response_format": {"type": "json_object", "json_schema": {"schema": CITY_SCHEMA}}},
            "response_format.json_schema",
        ),
    ]
    for body, param in cases:
        assert error_of(post(url, "/v1/chat/completions", body), "invalid_value")["param"] == param


def test_bad_requests_leave_others_untouched(url):
    """Refused bodies, sent while a greedy stream runs, neither disturb it nor leave anything behind."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    reference = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    bad = [(p, b) for p, b, _ in UNKNOWN + REFUSED] * 2
    with cf.ThreadPoolExecutor(4) as pool:
        stream = pool.submit(stream_events, url, "/v1/chat/completions", {**body, "stream": True})
        codes = list(pool.map(lambda pb: post(url, *pb).status_code, bad))
        events = stream.result()
    assert codes == [400] * len(bad)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == reference
    assert_server_idle(url)
