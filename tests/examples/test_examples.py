"""Every program in examples/ runs as a user runs it (`python examples/NAME.py` from the repo root, as a
subprocess) and does what it says. Each example ends with a `RESULT {json}` line; the checks below read it
(and the printed text) and verify the claim independently of the example's own `ok`."""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 150  # seconds per example

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str) -> tuple[dict, str]:
    """Run examples/NAME.py; return its RESULT json and its stdout. Its whole process group (an example's
    server included) is killed if it runs past the timeout, and must be gone when it exits."""
    # As a user with only the base install runs it (the openai client added for the example that uses it): the
    # extras' packages are hidden from it and from the servers it starts (tests/examples/base_install.py).
    from tests.examples.base_install import OPENAI_CLIENT, run_base

    allow = OPENAI_CLIENT if "openai" in name else frozenset()
    tmp = Path(tempfile.mkdtemp(prefix=f"example-{name}-"))
    out = run_base([f"examples/{name}.py", *args], tmp, allow=allow, cwd=ROOT, timeout=TIMEOUT)
    results = [line[len("RESULT ") :] for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 1, f"{name}.py printed {len(results)} RESULT lines:\n{out[-3000:]}"
    result = json.loads(results[0])
    assert result["ok"] is True
    return result, out


_EXAMPLES = (
    "quick_start",
    "json_extraction",
    "classification",
    "multi_turn_chat",
    "react_agent",
    "tree_of_thought",
    "rag_run_batch",
    "rag_openai_client",
)
_CONCURRENT = 3  # examples run at once: each is mostly start-up (imports, a model load, a server's processes)


@pytest.fixture(scope="module")
def examples():
    """Every example started at once (at most _CONCURRENT running), as independent processes: a test waits for
    its own and checks it. Their start-ups overlap; nothing else is shared between them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(_CONCURRENT) as pool:
        runs = {name: pool.submit(run_example, name) for name in _EXAMPLES}
        yield lambda name: runs[name].result()


def test_every_example_is_run():
    runnable = {p.stem for p in (ROOT / "examples").glob("*.py") if "__main__" in p.read_text()}
    assert set(_EXAMPLES) == runnable


def _argmax(scores) -> int:
    return max(range(len(scores)), key=lambda i: scores[i])


def test_quick_start(examples):
    result, out = examples("quick_start")
    assert "paris" in result["answer"].lower()
    assert 0 < result["completion_tokens"] <= 32
    assert "<|im_start|>assistant\n" + result["answer"] in out  # the program text went through the chat template


def test_json_extraction(examples):
    import jsonschema

    result, out = examples("json_extraction")
    texts, invoice_text = result["texts"], result["invoice_text"]
    assert len(result["people_raw"]) == len(texts) == 2
    for raw, parsed, text in zip(result["people_raw"], result["people"], texts):
        obj = json.loads(raw)  # what the model wrote is JSON ...
        jsonschema.validate(obj, result["schema"])  # ... valid against the schema
        assert obj == parsed
        assert str(obj["age"]) in text  # and extracted from the text, not made up
        assert obj["name"] and all(word in text for word in obj["name"].split())
        assert obj["city"] and obj["city"] in text
        assert repr(obj) in out  # the parsed value is printed
    raw = result["invoice_raw"]
    assert re.fullmatch(result["invoice_regex"], raw)
    inv = json.loads(raw)
    assert inv == result["invoice"]
    assert str(inv["invoice"]) in invoice_text and inv["date"] in invoice_text
    assert f"{inv['total']:.2f}" in invoice_text


def test_classification(examples):
    result, out = examples("classification")
    rows, labels = result["rows"], result["labels"]
    assert len(rows) == 6
    for row in rows:
        assert row["label"] in labels
        scores = [row["scores"][label] for label in labels]
        assert all(math.isfinite(s) for s in scores)
        assert labels[_argmax(scores)] == row["label"]  # select took the best-scoring choice
        assert f" {row['label']:9s} " in out
    assert len({row["label"] for row in rows}) > 1  # it tells the texts apart
    assert result["correct"] == sum(row["label"] == row["expected"] for row in rows) >= 3


def test_multi_turn_chat(examples):
    result, out = examples("multi_turn_chat")
    turns = result["turns"]
    assert len(turns) == 3
    assert result["roles"] == ["system"] + ["user", "assistant"] * 3
    for turn in turns:
        assert turn["assistant"].strip() and turn["assistant"] in out
        assert 0 < turn["completion_tokens"] <= 40
    for before, after in zip(turns, turns[1:]):
        # the next turn's prompt holds the whole previous prompt (and reply): it must come from the cache
        assert after["prompt_tokens"] > before["prompt_tokens"] + before["completion_tokens"]
        assert after["cached_tokens"] >= before["prompt_tokens"]


def _calc(expression: str) -> float:
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        return ops[type(node.op)](ev(node.left), ev(node.right))

    return ev(ast.parse(expression, mode="eval").body)


def test_react_agent(examples):
    result, out = examples("react_agent")
    steps = result["steps"]
    assert 1 <= len(steps) <= 4
    tool_steps = [s for s in steps if s["action"] in result["tools"]]
    assert tool_steps, "the agent called no tool"
    for step in steps:
        scores = list(step["scores"].values())
        assert all(math.isfinite(s) for s in scores), f"select chose {step['action']!r} from scores {scores}"
        assert list(step["scores"])[_argmax(scores)] == step["action"]
    for step in tool_steps:
        assert re.fullmatch(result["tool_regex"][step["action"]], step["input"])
        if step["action"] == "lookup":
            assert step["observation"] == str(result["population_millions"][step["input"]])
        else:
            assert float(step["observation"]) == pytest.approx(_calc(step["input"]), rel=1e-3)
        assert f"Observation: {step['observation']}" in out
    if steps[-1]["action"] == "finish":
        assert result["answer"] == steps[-1]["input"]
    else:
        assert result["answer"] is None and len(steps) == 4


def test_tree_of_thought(examples):
    result, out = examples("tree_of_thought")
    tree = result["tree"]
    assert len(tree) == 3 and all(len(node["steps"]) == 2 for node in tree)
    for node in tree:
        assert node["idea"].strip() and node["idea"] in out
        assert node["cached_tokens"] > 0  # the fork put the shared prefix in the cache before the branches ran
        for step in node["steps"]:
            assert step["step"].strip()
            assert step["useful"] in ("yes", "no")
            assert all(math.isfinite(s) for s in step["useful_scores"])
            assert ("yes", "no")[_argmax(step["useful_scores"])] == step["useful"]
    assert len({node["idea"] for node in tree}) > 1  # branches sampled with different seeds differ
    assert result["best"] in ("1", "2", "3")
    assert str(_argmax(result["best_scores"]) + 1) == result["best"]


def test_rag_run_batch(examples):
    result, out = examples("rag_run_batch")
    rows = result["rows"]
    assert len(rows) == 8
    assert all(row["answer"].strip() for row in rows)
    # one question computes the document; the others (batched with it) reuse it from the radix cache
    cached = [row for row in rows if row["cached_tokens"] > 0]
    assert len(cached) >= len(rows) - 1
    assert all(row["cached_tokens"] >= row["prompt_tokens"] // 2 for row in cached)
    assert result["cached_tokens"] == sum(row["cached_tokens"] for row in rows)
    assert sum(row["expected"].lower() in row["answer"].lower() for row in rows) >= 6
    for row in rows:
        assert f"cached_tokens={row['cached_tokens']}" in out


def test_rag_openai_client(examples):
    result, out = examples("rag_openai_client")
    rows = result["rows"]
    assert len(rows) == 5 and result["model"]
    assert all(row["answer"].strip() for row in rows)
    for row in rows[1:]:  # every question after the first finds the document in the server's cache
        assert row["cached_tokens"] >= row["prompt_tokens"] // 2
    assert sum(row["expected"].lower() in row["answer"].lower() for row in rows) >= 3
    for row in rows:
        assert f"cached_tokens={row['cached_tokens']}" in out
