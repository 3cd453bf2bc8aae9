"""The frontend language on the embedded SmolLM2: programs written as SGLang's frontend docs write them run
unchanged; misuse and failing backends give clear LangErrors; the OpenAI backend runs chat programs on the
server's /v1. Backends: conftest.py.
"""

from __future__ import annotations

import re

import pytest

import radixlm as sgl
from tests.helpers import free_port

# --- SGLang's documented programs, unchanged -------------------------------------------------------------
# (from SGLang's README / frontend docs and examples/frontend_language/usage/readme_examples.py; only the
# max_tokens numbers are smaller, to fit a CPU)


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=16))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=16))


@sgl.function
def tool_use(s, question):
    s += "To answer this question: " + question + ". "
    s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"]) + ". "
    if s["tool"] == "calculator":
        s += "The math expression is" + sgl.gen("expression")
    elif s["tool"] == "search engine":
        s += "The key word to search is" + sgl.gen("word")


@sgl.function
def tip_suggestion(s):
    s += "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=16, stop="\n\n")
    s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
    s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
    s += "In summary" + sgl.gen("summary")


@sgl.function
def regular_expression_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\n"
    s += "A: " + sgl.gen(
        "answer",
        temperature=0,
        regex=r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    )


@sgl.function
def text_qa(s, question):
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n")


@sgl.function
def chat_example(s):
    s += sgl.system("You are a helpful assistant.")
    # Same as: s += s.system("You are a helpful assistant.")
    with s.user():
        s += "Question: What is the capital of France?"
    s += sgl.assistant_begin()
    s += "Answer: " + sgl.gen("answer", max_tokens=16, stop="\n")
    s += sgl.assistant_end()


def test_sglang_multi_turn_question(default_backend, http_backend):
    default_backend(http_backend)
    state = multi_turn_question.run(
        question_1="What is the capital of the United States?",
        question_2="List two local attractions.",
        temperature=0,
    )
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[2]["content"] == state["answer_1"] and state["answer_1"]
    assert state.messages()[4]["content"] == state["answer_2"] and state["answer_2"]


def test_sglang_tool_use_and_tip_suggestion(default_backend, http_backend):
    default_backend(http_backend)
    state = tool_use.run(question="What is 5 + 5?", max_new_tokens=8)
    assert state["tool"] in ("calculator", "search engine")
    assert ("expression" if state["tool"] == "calculator" else "word") in state.variables
    meta = state.get_meta_info("tool")
    assert len(meta["input_token_logprobs"]) == 2

    state = tip_suggestion.run(max_new_tokens=8)
    text = state.text()
    assert text.startswith("Here are two tips for staying healthy: ")
    assert "\nTip 1:" in text and "\nTip 2:" in text and "Now, expand tip" not in text
    assert state.text().endswith("In summary" + state["summary"])


def test_sglang_regex_batching_streaming(default_backend, http_backend):
    default_backend(http_backend)
    state = regular_expression_gen.run()
    assert re.fullmatch(r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)", state["answer"])

    states = text_qa.run_batch(
        [
            {"question": "What is the capital of the United Kingdom?"},
            {"question": "What is the capital of France?"},
            {"question": "What is the capital of Japan?"},
        ],
        progress_bar=True,
        max_new_tokens=12,
    )
    assert len(states) == 3
    for st in states:
        assert st.error is None and "\n" not in st["answer"]
        assert st.text().startswith("Q: What is the capital of ")

    state = text_qa.run(question="What is the capital of France?", temperature=0.1, stream=True, max_new_tokens=12)
    streamed = "".join(state.text_iter())
    assert streamed == state.text() and streamed.startswith("Q: What is the capital of France?\nA:")


def test_sglang_chat_example_with_role_context_managers(default_backend, http_backend):
    default_backend(http_backend)
    state = chat_example.run(temperature=0)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[1]["content"] == "Question: What is the capital of France?"
    assert state.messages()[2]["content"] == "Answer: " + state["answer"]


def test_set_default_backend_accepts_an_engine(default_backend, fp32_engine, engine_backend):
    default_backend(fp32_engine)
    be = sgl.get_default_backend()
    try:
        assert isinstance(be, sgl.EngineBackend) and be.engine is fp32_engine
        state = text_qa.run(question="What is the capital of Japan?", temperature=0, max_new_tokens=8)
    finally:
        be.shutdown()  # its own driver thread; the engine is not its to shut down
    again = text_qa.run(
        question="What is the capital of Japan?", backend=engine_backend, temperature=0, max_new_tokens=8
    )
    assert state.text() == again.text()


# --- misuse and failing backends ------------------------------------------------------------------------------
def test_unknown_variable_names_it_and_lists_the_existing(engine_backend):
    @sgl.function
    def prog(s):
        s += "Say hi:" + sgl.gen("greeting", max_tokens=2)
        s += "Again:" + sgl.gen("second", max_tokens=2)

    st = prog.run(backend=engine_backend, temperature=0)
    with pytest.raises(sgl.LangError) as e:
        st["greting"]
    msg = str(e.value)
    assert "'greting'" in msg and "greeting" in msg and "second" in msg
    with pytest.raises(sgl.LangError, match="greting"):
        st.get_var("greting")


def test_select_with_no_choices_is_an_error(engine_backend):
    @sgl.function
    def prog(s):
        s += "Pick:" + sgl.select("x", choices=[])

    with pytest.raises(sgl.LangError, match="non-empty"):
        prog.run(backend=engine_backend)

    @sgl.function
    def prog2(s):
        s += "Pick:" + sgl.gen("x", choices=[])

    with pytest.raises(sgl.LangError, match="non-empty"):
        prog2.run(backend=engine_backend)


def test_endpoint_that_is_down_fails_at_construction():
    port = free_port()
    # the port is closed now: nothing listens there
    with pytest.raises(sgl.LangError, match=f"127.0.0.1:{port}"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}")


@sgl.function
def regex_prog(s, pattern):
    s += "Two digits: " + sgl.gen("d", regex=pattern, max_tokens=4)


def test_run_batch_keeps_a_failing_program_to_its_own_state(backend):
    states = regex_prog.run_batch(
        [{"pattern": r"[0-9]{2}"}, {"pattern": "("}, {"pattern": r"[1-5]"}], backend=backend, temperature=0
    )
    assert len(states) == 3
    bad = states[1]
    assert isinstance(bad.error, sgl.LangError)
    assert "regex is not a valid regular expression" in str(bad.error), str(bad.error)
    with pytest.raises(sgl.LangError):
        bad.text()
    assert states[0].error is None and re.fullmatch(r"[0-9]{2}", states[0]["d"])
    assert states[2].error is None and re.fullmatch(r"[1-5]", states[2]["d"])
    # run() of the failing program raises the same error
    with pytest.raises(sgl.LangError, match="(?i)regex"):
        regex_prog.run(pattern="(", backend=backend)


def test_image_says_there_is_no_vision(engine_backend):
    @sgl.function
    def prog(s):
        s += sgl.user(sgl.image("x.png") + "What is in this picture?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    with pytest.raises(sgl.LangError, match="no vision") as e:
        prog.run(backend=engine_backend)
    assert "x.png" in str(e.value)


def test_role_end_without_begin_is_an_error(engine_backend):
    @sgl.function
    def prog(s):
        s += "Hello"
        s += sgl.assistant_end()

    with pytest.raises(sgl.LangError, match=r"assistant_end\(\) without assistant_begin\(\)"):
        prog.run(backend=engine_backend)

    @sgl.function
    def prog2(s):
        s += sgl.user_begin() + "Hi"
        s += sgl.assistant_end()

    with pytest.raises(sgl.LangError, match="assistant_end"):
        prog2.run(backend=engine_backend)


# --- the OpenAI backend against the server's /v1 -------------------------------------------------------------
@sgl.function
def openai_chat(s, question):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=12))
    s += sgl.user("Is Paris in France? Answer yes or no.")
    s += sgl.assistant(sgl.select("yes_no", choices=["yes", "no"]))


def test_openai_backend_chat_and_select(openai_backend, http_backend):
    st = openai_chat.run(question="What is the capital of France?", backend=openai_backend, temperature=0)
    assert st["answer"]
    assert st["yes_no"] in ("yes", "no")
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert st.messages()[2]["content"] == st["answer"]
    meta = st.get_meta_info("answer")
    assert meta["completion_tokens"] <= 12 and meta["prompt_tokens"] > 0

    # the server applies the same chat template the native backend's role blocks use: same answer
    @sgl.function
    def native(s, question):
        s += sgl.system("You are a terse assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12))

    assert (
        native.run(question="What is the capital of France?", backend=http_backend, temperature=0)["answer"]
        == st["answer"]
    )


def test_openai_backend_gen_outside_assistant_is_an_error(openai_backend):
    @sgl.function
    def prog(s):
        s += sgl.user("Hello")
        s += "Reply: " + sgl.gen("x", max_tokens=4)

    with pytest.raises(sgl.LangError, match="assistant"):
        prog.run(backend=openai_backend)
