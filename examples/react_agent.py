# A ReAct-style agent: the model picks a tool with select, writes its input with a regex-constrained gen, and
# the program runs the tool in Python and appends the observation, for at most four steps.
import argparse
import ast
import json
import operator
import sys

import radixlm as sgl

POPULATION_MILLIONS = {"France": 68, "Japan": 125, "Brazil": 216, "Canada": 40, "Egypt": 112}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Arithmetic on numbers with + - * / and parentheses (no eval of arbitrary code)."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def lookup(country: str) -> str:
    return str(POPULATION_MILLIONS[country])


# name -> (the Python function, the regex its input must match)
TOOLS = {
    "lookup": (lookup, "(" + "|".join(POPULATION_MILLIONS) + ")"),
    "calculator": (calculator, r"\d{1,6}( [-+*/] \d{1,6}){1,2}"),
}
ACTIONS = [*TOOLS, "finish"]
FINISH_REGEX = r"[0-9A-Za-z ,.]{1,40}"

SYSTEM = """You answer questions with tools.
lookup: the population of a country in millions. Input: a country name.
calculator: computes arithmetic. Input: an expression.
finish: ends with the final answer. Input: the answer.

Example:
Question: What is the population of Canada plus 10 million?
Action: lookup
Action Input: Canada
Observation: 40
Action: calculator
Action Input: 40 + 10
Observation: 50
Action: finish
Action Input: 50 million"""


@sgl.function
def agent(s, question, max_steps=4):
    s += sgl.system(SYSTEM)
    s += sgl.user("Question: " + question)
    s += sgl.assistant_begin()
    steps = []
    for i in range(max_steps):
        s += "Action: " + sgl.select(f"action{i}", choices=ACTIONS) + "\n"
        action = s[f"action{i}"]  # reading a variable waits for it: the program branches on it in Python
        regex = FINISH_REGEX if action == "finish" else TOOLS[action][1]
        s += "Action Input: " + sgl.gen(f"input{i}", regex=regex, max_tokens=20, temperature=0) + "\n"
        step = {
            "action": action,
            "input": s[f"input{i}"],
            "scores": dict(zip(ACTIONS, s.get_meta_info(f"action{i}")["normalized_prompt_logprobs"])),
        }
        steps.append(step)
        if action == "finish":
            break
        step["observation"] = TOOLS[action][0](step["input"])  # run the tool in Python
        s += f"Observation: {step['observation']}\n"
    s += sgl.assistant_end()
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description="A ReAct-style tool-using agent.")
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    parser.add_argument("--question", default="How many people live in Brazil?")
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        state = agent.run(question=args.question)
        steps = state.ret_value
    finally:
        backend.shutdown()

    print(f"Question: {args.question}")
    for n, step in enumerate(steps, 1):
        scores = " ".join(f"{k}={v:.2f}" for k, v in step["scores"].items())
        print(f"[{n}] Action: {step['action']}   (scores: {scores})")
        print(f"    Action Input: {step['input']}")
        if "observation" in step:
            print(f"    Observation: {step['observation']}")
    answer = steps[-1]["input"] if steps[-1]["action"] == "finish" else None
    print(f"Final answer: {answer}" if answer is not None else f"No final answer within {len(steps)} steps.")
    tool_calls = [st for st in steps if st["action"] in TOOLS]
    ok = bool(tool_calls) and not any(st["observation"].startswith("error") for st in tool_calls)
    print(
        "RESULT "
        + json.dumps(
            {
                "ok": ok,
                "question": args.question,
                "tools": list(TOOLS),
                "tool_regex": {k: v[1] for k, v in TOOLS.items()},
                "population_millions": POPULATION_MILLIONS,
                "steps": steps,
                "answer": answer,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
