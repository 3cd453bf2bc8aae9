# Tree of thought with fork: three ideas, each expanded into two first steps that are checked with select, then
# a judge picks the best idea; all branches share the question's prefix in the radix cache.
import argparse
import json
import math
import sys

import radixlm as sgl

QUESTION = "How can I keep my houseplants alive while I am away on vacation for two weeks?"
N_IDEAS, N_STEPS = 3, 2


@sgl.function
def tree_of_thought(s, question):
    s += sgl.system("You are a practical assistant. Answer in one or two short sentences.")
    s += sgl.user(question)

    ideas = s.fork(N_IDEAS)  # three branches, run concurrently (batched together), different seeds
    for i, idea in enumerate(ideas):
        idea += sgl.assistant(sgl.gen("idea", max_tokens=24, temperature=0.8, seed=i))

    tree = []
    for i, idea in enumerate(ideas):
        idea += sgl.user("What is the very first step to do that?")
        steps = idea.fork(N_STEPS)  # expand every idea into several first steps
        for j, step in enumerate(steps):
            step += sgl.assistant(sgl.gen("step", max_tokens=20, temperature=0.8, seed=10 * i + j))
            step += sgl.user("Is that step useful? Answer yes or no.")
            step += sgl.assistant(sgl.select("useful", choices=["yes", "no"]))
        steps.join()
        tree.append(
            {
                "idea": idea["idea"],
                "idea_meta": idea.get_meta_info("idea"),
                "steps": [
                    {
                        "step": st["step"],
                        "useful": st["useful"],
                        "useful_scores": st.get_meta_info("useful")["normalized_prompt_logprobs"],
                    }
                    for st in steps
                ],
            }
        )

    # the judge sees every idea with its steps (and their checks) and picks one
    listing = "\n".join(
        f"{i + 1}. {node['idea']} First step: {node['steps'][0]['step']}" for i, node in enumerate(tree)
    )
    s += sgl.user(f"Here are {N_IDEAS} ideas:\n{listing}\nWhich idea is the best? Answer with its number.")
    s += sgl.assistant(sgl.select("best", choices=[str(i + 1) for i in range(N_IDEAS)]))
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description="Tree of thought with fork and select.")
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        state = tree_of_thought.run(question=QUESTION)
        tree, best = state.ret_value, state["best"]
        best_scores = state.get_meta_info("best")["normalized_prompt_logprobs"]
    finally:
        backend.shutdown()

    print(f"Question: {QUESTION}")
    for i, node in enumerate(tree):
        meta = node.pop("idea_meta")
        node["cached_tokens"], node["prompt_tokens"] = meta["cached_tokens"], meta["prompt_tokens"]
        print(f"{'*' if str(i + 1) == best else ' '} Idea {i + 1}: {node['idea']}")
        print(f"    (prompt_tokens={meta['prompt_tokens']}, cached_tokens={meta['cached_tokens']})")
        for st in node["steps"]:
            print(f"    -> first step: {st['step']}   (useful? {st['useful']})")
    print(f"The judge picks idea {best} (scores: {', '.join(f'{v:.2f}' for v in best_scores)})")
    ok = (
        len(tree) == N_IDEAS
        and all(len(n["steps"]) == N_STEPS for n in tree)
        and all(n["idea"].strip() and all(st["step"].strip() for st in n["steps"]) for n in tree)
        and all(math.isfinite(v) for v in best_scores)
    )
    print(
        "RESULT " + json.dumps({"ok": ok, "question": QUESTION, "tree": tree, "best": best, "best_scores": best_scores})
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
