# Classification with select: the model picks one label per text, scored by the logprob of each choice.
import argparse
import json
import math
import sys

import radixlm as sgl

LABELS = ["positive", "negative", "neutral"]
REVIEWS = [  # (text, the label a person would give)
    ("I absolutely love this phone, the battery lasts for days!", "positive"),
    ("Terrible service. The food was cold and the waiter was rude.", "negative"),
    ("Best concert I have ever been to, amazing energy.", "positive"),
    ("The package broke on the first day and support never answered. Awful.", "negative"),
    ("The store opens at 9 am and closes at 6 pm.", "neutral"),
    ("What a wonderful, delightful little book.", "positive"),
]


@sgl.function
def classify(s, text):
    s += sgl.system("You classify the sentiment of reviews. Reply with one word: positive, negative or neutral.")
    s += sgl.user(f"Review: {text}\nSentiment?")
    s += sgl.assistant(sgl.select("label", choices=LABELS))


def main() -> int:
    parser = argparse.ArgumentParser(description="Sentiment classification with select.")
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        states = classify.run_batch([{"text": text} for text, _ in REVIEWS])
        rows = []
        for (text, expected), st in zip(REVIEWS, states):
            if st.error is not None:
                raise st.error
            scores = st.get_meta_info("label")["normalized_prompt_logprobs"]
            rows.append({"text": text, "expected": expected, "label": st["label"], "scores": dict(zip(LABELS, scores))})
    finally:
        backend.shutdown()

    for r in rows:
        mark = "ok  " if r["label"] == r["expected"] else "MISS"
        scores = "  ".join(f"{k}={v:.2f}" for k, v in r["scores"].items())
        print(f"{mark} {r['label']:9s} ({scores})  {r['text']}")
    correct = sum(r["label"] == r["expected"] for r in rows)
    print(f"accuracy: {correct}/{len(rows)}")
    # worked: every text got a label from the list, chosen from real (finite) scores
    ok = all(r["label"] in LABELS and all(math.isfinite(v) for v in r["scores"].values()) for r in rows)
    print("RESULT " + json.dumps({"ok": ok, "labels": LABELS, "rows": rows, "correct": correct}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
