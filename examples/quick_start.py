# Quick start: a system/user/assistant program with one gen, run on a server that sgl.Runtime() launches.
import argparse
import json
import sys

import radixlm as sgl


@sgl.function
def qa(s, question):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=32, temperature=0))


def main() -> int:
    parser = argparse.ArgumentParser(description="The simplest radixlm.lang program.")
    parser.add_argument("--url", help="use a running server (e.g. http://127.0.0.1:30000) instead of launching one")
    args = parser.parse_args()

    # sgl.Runtime() starts `radixlm serve` on the embedded model in a subprocess and stops it on shutdown().
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        state = qa.run(question="What is the capital of France?")
        answer, meta = state["answer"], state.get_meta_info("answer")
    finally:
        backend.shutdown()

    print("--- the whole program text (chat template included) ---")
    print(state.text())
    print("--- the answer ---")
    print(answer)
    print(
        f"prompt_tokens={meta['prompt_tokens']} completion_tokens={meta['completion_tokens']} "
        f"finish_reason={meta['finish_reason']}"
    )
    ok = bool(answer.strip()) and meta["completion_tokens"] > 0
    print(
        "RESULT "
        + json.dumps(
            {
                "ok": ok,
                "answer": answer,
                "completion_tokens": meta["completion_tokens"],
                "finish_reason": meta["finish_reason"],
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
