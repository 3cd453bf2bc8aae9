# RAG with run_batch: many questions over one shared document; the document's tokens are computed once and
# every later question finds them in the radix cache (cached_tokens).
import argparse
import json
import sys

from rag_document import QUESTIONS, SYSTEM  # beside this script: python puts its folder on the path

import radixlm as sgl


@sgl.function
def rag(s, question):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))


def main() -> int:
    parser = argparse.ArgumentParser(description="RAG over a shared document with run_batch.")
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        # all questions at once: they are batched together and share the document's KV cache
        states = rag.run_batch([{"question": q} for q, _ in QUESTIONS])
        rows = []
        for (question, expected), st in zip(QUESTIONS, states):
            if st.error is not None:
                raise st.error
            meta = st.get_meta_info("answer")
            rows.append(
                {
                    "question": question,
                    "answer": st["answer"],
                    "expected": expected,
                    "correct": expected.lower() in st["answer"].lower(),
                    "prompt_tokens": meta["prompt_tokens"],
                    "cached_tokens": meta["cached_tokens"],
                }
            )
    finally:
        backend.shutdown()

    for r in rows:
        print(
            f"Q: {r['question']}\nA: {r['answer']}\n   prompt_tokens={r['prompt_tokens']} "
            f"cached_tokens={r['cached_tokens']} {'(contains ' + repr(r['expected']) + ')' if r['correct'] else ''}"
        )
    cached = sum(r["cached_tokens"] for r in rows)
    total = sum(r["prompt_tokens"] for r in rows)
    print(
        f"{cached} of {total} prompt tokens came from the cache; "
        f"{sum(r['correct'] for r in rows)}/{len(rows)} answers contain the expected word"
    )
    ok = all(r["answer"].strip() for r in rows) and cached > 0
    print("RESULT " + json.dumps({"ok": ok, "rows": rows, "cached_tokens": cached, "prompt_tokens": total}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
