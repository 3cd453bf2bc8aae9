# Multi-turn chat: several user/assistant turns in one program; each turn reuses the cached conversation so far.
import argparse
import json
import sys

import radixlm as sgl

TURNS = [
    "I want to bake bread at home. What do I need?",
    "How long should I knead the dough?",
    "And at what temperature do I bake it?",
]


@sgl.function
def chat(s, turns):
    s += sgl.system("You are a helpful assistant. Answer in one or two short sentences.")
    for i, message in enumerate(turns):
        s += sgl.user(message)
        s += sgl.assistant(sgl.gen(f"reply{i}", max_tokens=40, temperature=0))


def main() -> int:
    parser = argparse.ArgumentParser(description="A multi-turn conversation.")
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        state = chat.run(turns=TURNS)
        replies = [state[f"reply{i}"] for i in range(len(TURNS))]
        metas = [state.get_meta_info(f"reply{i}") for i in range(len(TURNS))]
        messages = state.messages()
    finally:
        backend.shutdown()

    turns = []
    for i, (message, reply, meta) in enumerate(zip(TURNS, replies, metas)):
        print(f"user:      {message}")
        print(f"assistant: {reply}")
        print(
            f"           (prompt_tokens={meta['prompt_tokens']}, cached_tokens={meta['cached_tokens']}, "
            f"completion_tokens={meta['completion_tokens']})"
        )
        turns.append(
            {
                "user": message,
                "assistant": reply,
                "prompt_tokens": meta["prompt_tokens"],
                "cached_tokens": meta["cached_tokens"],
                "completion_tokens": meta["completion_tokens"],
            }
        )
    print(f"{len(messages)} messages in the conversation: {[m['role'] for m in messages]}")
    ok = all(t["assistant"].strip() for t in turns) and len(messages) == 1 + 2 * len(TURNS)
    print("RESULT " + json.dumps({"ok": ok, "turns": turns, "roles": [m["role"] for m in messages]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
