"""Every constraint field a client of SGLang, vLLM or OpenAI sends works on both OpenAI routes of the launched
server: response_format, SGLang's json_schema / regex / ebnf, vLLM's guided_json / guided_regex / guided_choice
/ guided_grammar and structured_outputs; none is dropped without a word, and a bad one is a 400 naming the
field the client used."""

from __future__ import annotations

import json
import re

import openai
import pytest
from jsonschema import Draft202012Validator

from tests.helpers import assert_server_idle

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rank"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}"
CHOICES = ["red", "green", "blue"]
EBNF = 'root ::= "yes" | "no"'


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _check(kind: str, text: str) -> None:
    if kind == "json":
        Draft202012Validator(SCHEMA).validate(json.loads(text))
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert text in ("yes", "no"), text


FIELDS = [  # (extra body, what the answer must be)
    ({"json_schema": SCHEMA}, "json"),
    ({"regex": REGEX}, "regex"),
    ({"ebnf": EBNF}, "ebnf"),
    ({"guided_json": SCHEMA}, "json"),
    ({"guided_regex": REGEX}, "regex"),
    ({"guided_choice": CHOICES}, "choice"),
    ({"guided_grammar": EBNF}, "ebnf"),
    ({"structured_outputs": {"json": SCHEMA}}, "json"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_constraint_field_constrains_both_routes(server, client, route):
    for extra, kind in FIELDS:
        if route == "completions":
            r = client.completions.create(
                model=MODEL,
                prompt="A city and its rank as JSON, or a word: ",
                max_tokens=48,
                temperature=0.8,
                seed=3,
                extra_body=extra,
            )
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        else:
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Answer briefly."}],
                max_tokens=48,
                temperature=0.8,
                seed=3,
                extra_body=extra,
            )
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", (extra, text)
        _check(kind, text)
    assert_server_idle(server.url)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_constraints_are_400_naming_the_field(server, client, route):
    bad = [
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "guided_json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"jsonn": SCHEMA}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"regex": REGEX, "guided_json": SCHEMA}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
        ),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            if route == "completions":
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body=extra)
            else:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, extra_body=extra
                )
        body = info.value.body
        assert body["type"] == "invalid_request_error" and body["param"] == param, (extra, body)
    assert_server_idle(server.url)
