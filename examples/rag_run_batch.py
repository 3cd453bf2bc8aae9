# RAG with run_batch: many questions over one shared document; the document's tokens are computed once and
# every later question finds them in the radix cache (cached_tokens).
import argparse
import json
import sys

import radixlm as sgl

DOCUMENT = """The Lumen Valley Observatory was founded in 1962 by the astronomer Clara Whitfield. It sits on
Mount Arden, 2,340 meters above sea level, about 80 kilometers north of the town of Brenholm. Its largest
instrument is the Whitfield Telescope, a reflecting telescope with a mirror 3.6 meters across, installed in
1988. The observatory is run by the University of Brenholm and employs 45 people, including 12 astronomers.
Every year about 20,000 visitors come to its public open nights, which take place on the first Saturday of
each month from April to October. In 2015 the observatory discovered a comet, later named Comet Arden, which
passes near the Sun every 74 years. The site was chosen for its dry climate: it has clear skies on about
300 nights a year."""
SYSTEM = "Answer the question using only this document.\n\n" + DOCUMENT

QUESTIONS = [  # (question, a word the right answer contains)
    ("Who founded the observatory?", "Whitfield"),
    ("In which year was the observatory founded?", "1962"),
    ("On which mountain is the observatory?", "Arden"),
    ("How wide is the mirror of the Whitfield Telescope?", "3.6"),
    ("Which university runs the observatory?", "Brenholm"),
    ("How many people work at the observatory?", "45"),
    ("When are the public open nights held?", "Saturday"),
    ("What did the observatory discover in 2015?", "comet"),
]


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
            rows.append({"question": question, "answer": st["answer"], "expected": expected,
                         "correct": expected.lower() in st["answer"].lower(),
                         "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"]})
    finally:
        backend.shutdown()

    for r in rows:
        print(f"Q: {r['question']}\nA: {r['answer']}\n   prompt_tokens={r['prompt_tokens']} "
              f"cached_tokens={r['cached_tokens']} {'(contains ' + repr(r['expected']) + ')' if r['correct'] else ''}")
    cached = sum(r["cached_tokens"] for r in rows)
    total = sum(r["prompt_tokens"] for r in rows)
    print(f"{cached} of {total} prompt tokens came from the cache; "
          f"{sum(r['correct'] for r in rows)}/{len(rows)} answers contain the expected word")
    ok = all(r["answer"].strip() for r in rows) and cached > 0
    print("RESULT " + json.dumps({"ok": ok, "rows": rows, "cached_tokens": cached, "prompt_tokens": total}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
