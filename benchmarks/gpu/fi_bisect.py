"""Which prompts does FlashInfer get wrong on SmolLM2 (64-wide heads, 9 query heads over 3 KV heads)?

Greedy continuations of prompts of growing length, FlashInfer vs Triton (the reference that matches the CPU),
with piecewise CUDA graphs on and off and each FlashInfer prefill backend; then a cached-prefix extend.

    python benchmarks/gpu/fi_bisect.py [--out bisect.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import radixlm  # noqa: E402

LENGTHS = [3, 5, 6, 8, 11, 16, 17, 22, 32, 33, 48, 64, 100, 200]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def continuations(engine, prompts: list[list[int]], batched: bool) -> list[list[int]]:
    if batched:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    out = []
    for p in prompts:
        engine.flush_cache()
        out.append(engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = [("triton", {}), ("flashinfer", {}), ("flashinfer", {"disable_piecewise_cuda_graph": True}),
               ("flashinfer", {"disable_piecewise_cuda_graph": True, "disable_cuda_graph": True}),
               ("flashinfer", {"flashinfer_prefill_backend": "fa3"})]
    text = ("The history of France is long and full of kings, revolutions and republics; its capital, Paris, "
            "sits on the Seine and has been the center of its culture for centuries. ") * 8
    results, ref = [], None
    for backend, extra in configs:
        eng = radixlm.Engine(device="cuda", attention_backend=backend, log_level="warning", max_total_tokens=8192,
                             **extra)
        ids = eng.tokenizer(text)["input_ids"]
        prompts = [ids[:n] for n in LENGTHS]
        alone = continuations(eng, prompts, batched=False)
        batch = continuations(eng, prompts, batched=True)  # one ragged extend batch (cache flushed before)
        eng.flush_cache()
        eng.generate(input_ids=ids[:150], sampling_params={"max_new_tokens": 1})  # cache a 150-token prefix
        cached = continuations(eng, [ids[:n] for n in (160, 200)], batched=True)  # extends with a prefix
        eng.shutdown()
        row = {"backend": backend, **extra, "alone": alone, "batch": batch, "cached": cached}
        if ref is None:
            ref = row
        row["alone_ok"] = {n: a == r for n, a, r in zip(LENGTHS, alone, ref["alone"])}
        row["batch_ok"] = {n: a == r for n, a, r in zip(LENGTHS, batch, ref["alone"])}
        row["cached_ok"] = [a == r for a, r in zip(cached, ref["cached"])]
        results.append(row)
        bad = [n for n, ok in row["alone_ok"].items() if not ok]
        print(f"{backend} {extra}: alone wrong at lengths {bad}; batch wrong at "
              f"{[n for n, ok in row['batch_ok'].items() if not ok]}; cached-prefix ok {row['cached_ok']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
