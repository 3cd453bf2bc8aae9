"""The embedded SmolLM2 (GGUF) on CUDA: greedy answers per attention backend and dtype, against the
CPU fp32 engine's. SmolLM2 has 64-wide heads and 9 query heads over 3 KV heads (a GQA group of 3), a shape the
8B benchmarks never run.

    python benchmarks/gpu/smol_cuda_check.py [--backends torch_native triton flashinfer] [--out check.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import radixlm  # noqa: E402

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Water boils at"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def run(engine) -> dict:
    outs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    chat = engine.chat(CHAT, GREEDY)["text"]
    first = engine.generate(input_ids=engine.chat_ids(CHAT), sampling_params={"temperature": 0, "max_new_tokens": 1},
                            return_logprob=True, top_logprobs_num=5)["meta_info"]
    top = first.get("output_top_logprobs") or [[]]
    return {"outputs": outs, "chat": chat, "chat_top5": [(round(float(lp), 4), int(t)) for lp, t, *_ in top[0]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["torch_native", "triton", "flashinfer"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ref_engine = radixlm.Engine(device="cpu", log_level="warning", max_total_tokens=4096)
    ref = run(ref_engine)
    ref_engine.shutdown()
    print(f"cpu fp32: chat {ref['chat']!r}, first-token top-5 logprobs {ref['chat_top5']}", flush=True)
    rows = []
    for dtype in args.dtypes:
        for backend in args.backends:
            try:
                eng = radixlm.Engine(device="cuda", dtype=dtype, attention_backend=backend, log_level="warning",
                                     max_total_tokens=8192)
                got = run(eng)
                eng.shutdown()
            except Exception as e:  # one broken combination must not hide the others
                rows.append({"dtype": dtype, "backend": backend, "error": f"{type(e).__name__}: {e}"[:500]})
                print(rows[-1], flush=True)
                continue
            same = sum(a == b for a, b in zip(got["outputs"], ref["outputs"]))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                     for a, b in zip(got["outputs"], ref["outputs"])]
            row = {"dtype": dtype, "backend": backend, "identical_to_cpu": f"{same}/{len(PROMPTS)}",
                   "first_divergence": first, "chat": got["chat"], "paris": "Paris" in got["chat"],
                   "chat_top5": got["chat_top5"]}
            rows.append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"reference_chat": ref["chat"], "reference_top5": ref["chat_top5"],
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
