"""Single-stream decode speed of llama.cpp (llama-cpp-python) on a GGUF: the peer row for bench_decode.py.

Shaped like `benchmarks/bench_decode.py --batch-sizes 1 --context 64`: a prompt of --context tokens is
evaluated first, then single-token decode steps are timed one by one (forward of one token + greedy argmax of the
last logits, the same work as our served decode step). Each repeat starts from a fresh KV cache; the figure is the
median step time over all timed steps of all repeats (the context grows by --steps tokens over a repeat, so keep
--steps small next to --context to stay near the fixed context of bench_decode).

    python benchmarks/cpu/llamacpp_decode.py --context 64 --out /tmp/llamacpp_decode.json

Needs `pip install -e '.[cpu-peers]'` (llama-cpp-python, see benchmarks/cpu/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

DEFAULT_GGUF = os.path.expanduser("~/.cache/radixlm/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def decode_times(llm, context: int, steps: int, repeats: int) -> tuple[list[float], list[float]]:
    """Per-step decode seconds (all repeats) and per-repeat prefill seconds of the `context`-token prompt."""
    import llama_cpp

    n_vocab = llm.n_vocab()
    # Fixed ids like bench_decode's BatchSpec (100 + i): no tokenizer in the timed path, same prompt every repeat.
    prompt = [100 + i for i in range(context)]
    step_s: list[float] = []
    prefill_s: list[float] = []
    for rep in range(repeats + 1):  # repeat 0 warms up caches and threads and is not counted
        llm.reset()  # n_tokens = 0: the next eval drops the KV cache from position 0 on
        t = time.perf_counter()
        llm.eval(prompt)
        times = [time.perf_counter() - t]
        tok = _argmax(llama_cpp, llm, n_vocab)
        for _ in range(steps):
            t = time.perf_counter()
            llm.eval([tok])
            tok = _argmax(llama_cpp, llm, n_vocab)  # greedy, as our step samples with temperature 0
            times.append(time.perf_counter() - t)
        if rep:
            prefill_s.append(times[0])
            step_s += times[1:]
    return step_s, prefill_s


def _argmax(llama_cpp, llm, n_vocab: int) -> int:
    # Logits of the last evaluated token straight from the context (Llama.scores is only filled with logits_all).
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(n_vocab,))
    return int(logits.argmax())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=DEFAULT_GGUF)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens evaluated before the timed steps")
    ap.add_argument("--steps", type=int, default=32, help="timed single-token decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--n-ctx", type=int, default=0, help="0: context + steps rounded up to 256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(
            f"llama_cpp is not importable ({e}): pip install -e '.[cpu-peers]' (see benchmarks/cpu/README.md)"
        )

    n_ctx = args.n_ctx or -(-(args.context + args.steps + 1) // 256) * 256
    t = time.perf_counter()
    llm = llama_cpp.Llama(
        args.model_path,
        n_threads=args.n_threads,
        n_threads_batch=args.n_threads,
        n_ctx=n_ctx,
        n_batch=args.n_batch,
        verbose=False,
    )
    load_s = time.perf_counter() - t
    step_s, prefill_s = decode_times(llm, args.context, args.steps, args.repeats)
    step = statistics.median(step_s)
    prefill = statistics.median(prefill_s)
    row = {
        "batch": 1,
        "context": args.context,
        "backend": "llama.cpp",
        "kernels": "ggml",
        "cuda_graph": False,
        "step_ms": step * 1e3,
        "tokens_per_s": 1 / step,
        "mean_step_ms": statistics.fmean(step_s) * 1e3,
        "p90_step_ms": statistics.quantiles(step_s, n=10)[-1] * 1e3 if len(step_s) > 1 else step * 1e3,
        "prefill_ms": prefill * 1e3,
        "prefill_tokens_per_s": args.context / prefill,
    }
    print(
        f"{'llama.cpp':>12} threads={args.n_threads} batch    1: {step * 1e3:8.2f} ms/step {1 / step:9.1f} tokens/s"
        f"   (prefill {args.context} tokens {prefill * 1e3:.1f} ms, load {load_s:.2f} s)",
        flush=True,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": platform.processor() or platform.machine(),
                    "engine": "llama.cpp",
                    "version": llama_cpp.__version__,
                    "model": args.model_path,
                    "n_threads": args.n_threads,
                    "n_ctx": n_ctx,
                    "n_batch": args.n_batch,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "load_s": load_s,
                    "rows": [row],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
