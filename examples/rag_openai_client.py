# RAG through the official openai client against a radixlm server this script launches: every question repeats
# the document, and usage.prompt_tokens_details.cached_tokens shows the server reusing it from the radix cache.
import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
from rag_document import QUESTIONS as ALL_QUESTIONS  # beside this script (shared with rag_run_batch.py)
from rag_document import SYSTEM

import radixlm as sgl

QUESTIONS = [ALL_QUESTIONS[i] for i in (0, 1, 3, 4, 7)]  # five of them: the founder, year, mirror, university, comet


def main() -> int:
    parser = argparse.ArgumentParser(description="RAG with the openai client and prefix caching.")
    parser.add_argument("--url", help="use a running server instead of launching one with sgl.Runtime()")
    args = parser.parse_args()

    runtime = None if args.url else sgl.Runtime(log_level="warning")  # `radixlm serve` in a subprocess
    base_url = args.url or runtime.url
    try:
        client = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="none")
        model = client.models.list().data[0].id

        def ask(question: str) -> dict:
            r = client.chat.completions.create(
                model=model,
                temperature=0,
                max_tokens=24,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            )
            details = r.usage.prompt_tokens_details
            return {
                "question": question,
                "answer": r.choices[0].message.content,
                "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details is not None else 0,
            }

        # The first question puts the document in the server's radix cache; the rest go out concurrently
        # (the server batches them) and all find it there.
        questions = [q for q, _ in QUESTIONS]
        rows = [ask(questions[0])]
        with ThreadPoolExecutor(max_workers=len(questions) - 1) as pool:
            rows += list(pool.map(ask, questions[1:]))
    finally:
        if runtime is not None:
            runtime.shutdown()

    for row, (_, expected) in zip(rows, QUESTIONS):
        row["expected"], row["correct"] = expected, expected.lower() in row["answer"].lower()
        print(
            f"Q: {row['question']}\nA: {row['answer']}\n"
            f"   prompt_tokens={row['prompt_tokens']} cached_tokens={row['cached_tokens']}"
        )
    print(f"model {model}: {sum(r['correct'] for r in rows)}/{len(rows)} answers contain the expected word")
    # the first question may be a cache miss; every later one must reuse the document's tokens
    ok = all(r["answer"].strip() for r in rows) and all(r["cached_tokens"] > 0 for r in rows[1:])
    print("RESULT " + json.dumps({"ok": ok, "model": model, "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
