"""OpenAI function calling through the official `openai` client against the launched server: forced calls
(tool_choice required / named), auto, none, a follow-up turn with the tool's result, and bad input.

Every call the server returns must be one the client can use as is: an id, type "function", an allowed name
and `arguments` a JSON string valid against that tool's parameter schema (checked with `jsonschema`).
Schemas here stay inside what the default grammar backend (outlines) enforces; the keywords it cannot
enforce (numeric bounds, uniqueItems) must be refused with a 400 instead."""

import concurrent.futures as cf
import json

import jsonschema
import openai
import pytest

from tests.helpers import assert_server_idle

MODEL = "SmolLM2-135M-Instruct"
BEGIN, END = "<tool_call>\n", "\n</tool_call>"  # the Hermes-style markup the model writes calls in

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$", "description": "city name"},
                "unit": {"type": "string", "enum": ["c", "f"], "description": "c for celsius, f for fahrenheit"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
EVENTS = {
    "type": "function",
    "function": {
        "name": "list_events",
        "description": "List upcoming events in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                # a bounded integer the outlines backend can enforce (it refuses minimum/maximum, see below)
                "days": {"type": "integer", "enum": [1, 2, 3, 4, 5, 6, 7]},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^[a-z_]{1,10}$"},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["city", "days", "tags"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, EVENTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

ASK = [
    {"role": "system", "content": "You are a helpful assistant. Always use the tools to answer."},
    {"role": "user", "content": "What is the weather in Paris in celsius?"},
]
# A shot of the call format in the conversation: the prompt that most often gets this small model to call.
SHOT = [
    {"role": "system", "content": "You are a weather bot. Reply only with a tool call."},
    {"role": "user", "content": "Weather in London, fahrenheit?"},
    {
        "role": "assistant",
        "content": BEGIN + json.dumps({"name": "get_weather", "arguments": {"city": "London", "unit": "f"}}) + END,
    },
    {"role": "user", "content": "Weather in Paris, celsius?"},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_TOKENS = 200  # enough for the longest call these schemas allow (strings and arrays are bounded)
# A call never contains these (names, enums and patterns exclude a period, and call markup and JSON have single
# newlines only), so they cut text answers short (this model rambles) without ever cutting a call.
TEXT_STOP = [".", "\n\n"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def nothing_leaked(server):
    """After this file's requests (good, bad, streamed, sampled): the scheduler is idle, no grammar waits, and
    after a cache flush every KV slot is free again."""
    yield
    assert_server_idle(server.url)


# --- helpers ----------------------------------------------------------------------------------------------------
def check_call(call_id, call_type, name, arguments, allowed) -> dict:
    """One tool call as a client would use it; returns the parsed arguments."""
    assert isinstance(call_id, str) and call_id, call_id
    assert call_type == "function"
    assert name in allowed, (name, allowed)
    assert isinstance(arguments, str), arguments  # a JSON *string*, not an object
    args = json.loads(arguments)
    jsonschema.Draft202012Validator(SCHEMAS[name]).validate(args)
    return args


def check_message_calls(message, allowed) -> list[tuple[str, dict]]:
    calls = message.tool_calls
    assert calls, message
    out = [(c.function.name, check_call(c.id, c.type, c.function.name, c.function.arguments, allowed)) for c in calls]
    assert len({c.id for c in calls}) == len(calls)
    return out


def collect_stream(stream) -> dict[int, dict]:
    """Reassemble a streamed chat answer per choice the way client code does: content fragments joined,
    delta.tool_calls merged by their index (id / name / arguments fragments concatenated), one finish_reason."""
    out: dict[int, dict] = {}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for ch in chunk.choices:
            st = out.setdefault(ch.index, {"content": "", "calls": {}, "finish": None, "role": None})
            assert st["finish"] is None, f"choice {ch.index} got a chunk after its finish_reason"
            d = ch.delta
            if d.role:
                st["role"] = d.role
            st["content"] += d.content or ""
            for tc in d.tool_calls or []:
                slot = st["calls"].setdefault(tc.index, {"id": "", "type": None, "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["type"] = tc.type or slot["type"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                st["finish"] = ch.finish_reason
    for i, st in out.items():
        assert st["role"] == "assistant", (i, st)
        assert st["finish"] is not None, f"choice {i}: the stream ended without a finish_reason"
    return out


def check_streamed_calls(st, allowed) -> list[tuple[str, dict]]:
    assert st["calls"], st
    assert sorted(st["calls"]) == list(range(len(st["calls"])))  # indexes 0..k-1
    calls = [st["calls"][k] for k in sorted(st["calls"])]
    out = [(c["name"], check_call(c["id"], c["type"], c["name"], c["arguments"], allowed)) for c in calls]
    assert len({c["id"] for c in calls}) == len(calls)
    return out


def check_auto_answer(content, calls, finish) -> str:
    """tool_choice auto: either a text answer or well-formed calls, never a mix of garbage. Returns the kind.
    `calls` is None or the result of check_message_calls / check_streamed_calls' input."""
    if calls:
        assert finish == "tool_calls", finish
        # whatever text came with the calls carries no raw call markup
        assert content is None or ("<tool_call>" not in content and "</tool_call>" not in content), content
        return "tool_calls"
    assert finish in ("stop", "length"), finish
    assert isinstance(content, str)
    # The grammar lets the model write any text that does not open a call; this model always has something
    # to say here (its own probability of ending at once is ~e^-16), so an empty answer is a broken grammar.
    assert content.strip(), f"empty text answer (finish_reason {finish})"
    # text that opens a call is constrained to be a complete, valid call, which the server would have parsed
    assert not content.startswith(BEGIN), content
    return "text"


def check_greedy_free_text(logprobs_content):
    """Temperature 0 under the auto grammar: until a call opens, every token the model prefers is allowed, so
    each sampled token must be the model's own top choice (a grammar that masks free text fails this)."""
    assert logprobs_content, "no logprobs returned"
    text = ""
    for pos, entry in enumerate(logprobs_content):
        if text.startswith(BEGIN):
            break  # inside a call: constrained, the top token may be masked
        top = max(entry.top_logprobs, key=lambda t: t.logprob)
        if not (text + top.token).startswith(BEGIN):
            assert entry.logprob >= top.logprob - 1e-4, (
                f"token {pos}: sampled {entry.token!r} ({entry.logprob:.2f}) although the model's top choice "
                f"{top.token!r} ({top.logprob:.2f}) is allowed; text so far {text!r}"
            )
        text += entry.token


def create(client, **kw):
    return client.chat.completions.create(model=MODEL, **kw)


# --- 1. forced calls: tool_choice required and a named function ---------------------------------------------------
@pytest.fixture(scope="module")
def named_answer(client):
    return create(client, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=CALL_TOKENS)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_call_streamed_and_not(client, named_answer, choice):
    tool_choice, allowed = ("required", set(SCHEMAS)) if choice == "required" else (NAMED, {"get_weather"})
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=CALL_TOKENS)
    r = named_answer if choice == "named" else create(client, **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.role == "assistant"
    assert not c.message.content  # a forced answer is the call alone
    calls = check_message_calls(c.message, allowed)
    assert len(calls) == 1
    assert r.usage.completion_tokens > 0

    streamed = collect_stream(create(client, **kw, stream=True))
    assert list(streamed) == [0]
    st = streamed[0]
    assert st["finish"] == "tool_calls"
    assert st["content"] == ""
    # greedy: the streamed call is the same call (ids are fresh per answer)
    assert check_streamed_calls(st, allowed) == calls
    assert st["calls"][0]["id"] != c.message.tool_calls[0].id


# --- 3. tool_choice none --------------------------------------------------------------------------------------
def test_tool_choice_none_gives_text(client):
    # SHOT shows the call markup in the conversation; with "none" nothing may be turned into a call
    r = create(client, messages=SHOT, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=16)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length"), c
    assert c.message.tool_calls is None
    assert isinstance(c.message.content, str) and c.message.content.strip()
    streamed = collect_stream(
        create(client, messages=SHOT, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=16, stream=True)
    )
    assert streamed[0]["calls"] == {} and streamed[0]["finish"] == c.finish_reason
    assert streamed[0]["content"] == c.message.content


# --- 4. follow-up turn with the tool's result ---------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_follow_up_turn_with_tool_result(client, named_answer, tool_choice):
    message = named_answer.choices[0].message  # exactly as the client returned it
    call = message.tool_calls[0]
    messages = [
        ASK[1],
        message,
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "temperature": 17, "unit": "c", "sky": "light rain"}),
        },
    ]
    if tool_choice == "none":  # no call can come: a short answer will do
        r = create(client, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=32)
    else:
        r = create(
            client,
            messages=messages,
            tools=TOOLS,
            tool_choice="auto",
            temperature=0,
            max_tokens=CALL_TOKENS,
            stop=TEXT_STOP,
        )
    c = r.choices[0]
    if tool_choice == "none":
        assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
        assert isinstance(c.message.content, str) and c.message.content.strip()
        assert "17" in c.message.content  # the model read the tool's result
    else:
        calls = check_message_calls(c.message, set(SCHEMAS)) if c.message.tool_calls else None
        check_auto_answer(c.message.content, calls, c.finish_reason)


# --- 5. bad input ---------------------------------------------------------------------------------------------
def _tool(parameters, name="f"):
    return [{"type": "function", "function": {"name": name, "parameters": parameters}}]


BAD = {
    "named function not among the tools": (
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
        ["get_time"],
    ),
    "tool_choice without tools": (dict(tool_choice="required"), ["tool_choice"]),
    "parameters not an object": (dict(tools=_tool("nope"), tool_choice="required"), ["parameters"]),
    "unknown type": (dict(tools=_tool({"type": "object", "properties": {"x": {"type": "strnig"}}})), ["strnig"]),
    "properties not an object": (
        dict(tools=_tool({"type": "object", "properties": "x"}), tool_choice="required"),
        ["properties"],
    ),
    "dangling $ref": (
        dict(tools=_tool({"type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}}), tool_choice="required"),
        ["$defs"],
    ),
    "required not an array": (
        dict(
            tools=_tool({"type": "object", "properties": {"x": {"type": "string"}}, "required": "x"}),
            tool_choice="required",
        ),
        ["required"],
    ),
    "unsatisfiable empty enum": (
        dict(
            tools=_tool({"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]}),
            tool_choice="required",
        ),
        ["enum"],
    ),
    "uniqueItems (no backend enforces it)": (
        dict(
            tools=_tool(
                {
                    "type": "object",
                    "properties": {"x": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
                }
            )
        ),
        ["uniqueItems"],
    ),
    "parameters of a type other than object": (
        dict(tools=_tool({"type": "string"}), tool_choice="required"),
        ["parameters", "object"],
    ),
    "a function name OpenAI would refuse": (
        dict(tools=_tool({"type": "object"}, name="has space!"), tool_choice="required"),
        ["name", "has space!"],
    ),
    "tool message without tool_call_id": (
        dict(
            messages=[
                ASK[1],
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": json.dumps({"city": "Paris", "unit": "c"}),
                            },
                        }
                    ],
                },
                {"role": "tool", "content": json.dumps({"temperature": 17})},
            ],
            tools=TOOLS,
        ),
        ["tool_call_id"],
    ),
}


def test_bad_requests_are_400_and_others_unaffected(server, client, named_answer):
    good_kw = dict(messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=CALL_TOKENS)

    def bad(item):
        label, (kw, words) = item
        kw = {"messages": ASK, "max_tokens": 8, **kw}
        try:
            r = create(client, **kw)
        except openai.BadRequestError as e:
            return label, e, words
        return label, r, words

    with cf.ThreadPoolExecutor(4) as pool:
        good = pool.submit(lambda: collect_stream(create(client, **good_kw, stream=True)))  # in flight meanwhile
        results = list(pool.map(bad, BAD.items()))
        good = good.result()
    failures = []
    for label, got, words in results:
        if not isinstance(got, openai.BadRequestError):
            failures.append(f"{label}: accepted (200): {got.choices[0].model_dump(exclude_none=True)}")
            continue
        err = got.body
        if got.status_code != 400 or not isinstance(err, dict) or err.get("type") != "invalid_request_error":
            failures.append(f"{label}: not an OpenAI-shaped 400: {got.status_code} {err}")
        elif not all(w in err.get("message", "") for w in words):
            failures.append(f"{label}: the message does not name {words}: {err}")
    assert not failures, "\n".join(failures)
    # the request in flight alongside them got its call, the same as before
    assert good[0]["finish"] == "tool_calls"
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in named_answer.choices[0].message.tool_calls]
    assert check_streamed_calls(good[0], {"get_weather"}) == expected
    # and a plain request after them works
    r = create(client, messages=ASK, temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_cut_by_max_tokens_is_an_error(client, stream):
    """tool_choice required: the answer is a whole call or an error, never the call's markup as content."""
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=6)
    if not stream:
        with pytest.raises(openai.BadRequestError) as info:
            create(client, **kw)
        assert info.value.body["param"] == "max_tokens" and "tool call" in info.value.body["message"]
        return
    with pytest.raises(openai.APIError) as info:
        list(create(client, **kw, stream=True))
    assert "tool call" in str(info.value)


# --- 2. tool_choice auto --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["ask", "shot"])
def test_auto_greedy(client, record_property, prompt):
    messages = ASK if prompt == "ask" else SHOT
    kw = dict(messages=messages, tools=TOOLS, temperature=0, max_tokens=CALL_TOKENS, stop=TEXT_STOP)  # auto: default
    r = create(client, **kw, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    check_greedy_free_text(c.logprobs.content)
    calls = check_message_calls(c.message, set(SCHEMAS)) if c.message.tool_calls else None
    kind = check_auto_answer(c.message.content, calls, c.finish_reason)
    record_property(f"auto_greedy_{prompt}", kind)
    print(f"auto, temperature 0, prompt {prompt}: {kind}: {calls or c.message.content!r}")

    explicit = create(client, **kw, tool_choice="auto", stream=True)
    st = collect_stream(explicit)[0]
    s_calls = check_streamed_calls(st, set(SCHEMAS)) if st["calls"] else None
    assert (
        check_auto_answer(st["content"] if s_calls is None else (st["content"] or None), s_calls, st["finish"]) == kind
    )
    assert st["finish"] == c.finish_reason
    if kind == "text":
        assert st["content"] == c.message.content
    else:
        assert s_calls == calls


def test_auto_sampled_answers_are_well_formed(client, record_property):
    kinds = []
    r = create(
        client,
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        temperature=0.8,
        seed=1,
        n=3,
        max_tokens=CALL_TOKENS,
        stop=TEXT_STOP,
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        calls = check_message_calls(c.message, set(SCHEMAS)) if c.message.tool_calls else None
        kinds.append(check_auto_answer(c.message.content, calls, c.finish_reason))
    for seed in (2, 3):
        streamed = collect_stream(
            create(
                client,
                messages=SHOT,
                tools=TOOLS,
                tool_choice="auto",
                temperature=0.8,
                seed=seed,
                n=2,
                max_tokens=CALL_TOKENS,
                stop=TEXT_STOP,
                stream=True,
            )
        )
        assert sorted(streamed) == [0, 1]
        for st in streamed.values():
            calls = check_streamed_calls(st, set(SCHEMAS)) if st["calls"] else None
            kinds.append(
                check_auto_answer(st["content"] if calls is None else (st["content"] or None), calls, st["finish"])
            )
    record_property("auto_sampled_kinds", ",".join(kinds))
    print("auto, temperature 0.8:", kinds)
