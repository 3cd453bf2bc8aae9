"""Decode throughput of the model runner alone: fixed batches at a fixed context, median step time.

    python benchmarks/bench_decode.py --batch-sizes 1 16 --context 128
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import radixlm
from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode


def step_time(engine, bs: int, ctx: int, repeats: int) -> float:
    r = engine.runner
    rows = [r.req_to_token_pool.alloc() for _ in range(bs)]
    slots = r.token_to_kv_pool.alloc(bs * (ctx + 1))
    for i, row in enumerate(rows):
        r.req_to_token_pool.write(row, 0, slots[i * (ctx + 1):(i + 1) * (ctx + 1)])
    loc = slots.view(bs, ctx + 1)[:, ctx].clone()
    sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda: None)

    def step():
        fb = ForwardBatch.build(ForwardMode.DECODE, r.device, input_ids=[100] * bs, positions=[ctx] * bs,
                                req_pool_indices=rows, seq_lens=[ctx + 1] * bs, out_cache_loc=loc,
                                logits_indices=list(range(bs)))
        logits = r.forward(fb)
        return logits.argmax(-1).tolist()  # the one host sync per step a real decode has

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    r.token_to_kv_pool.free(slots)
    for row in rows:
        r.req_to_token_pool.free(row)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = radixlm.Engine(args.model_path, tokenizer_path=args.tokenizer_path, load_format=args.load_format, dtype=args.dtype, log_level="warning",
                            max_total_tokens=max(args.batch_sizes) * (args.context + 1) + 64,
                            max_running_requests=max(args.batch_sizes))
    rows = []
    for bs in args.batch_sizes:
        t = step_time(engine, bs, args.context, args.repeats)
        rows.append({"batch": bs, "context": args.context, "step_ms": t * 1e3, "tokens_per_s": bs / t})
        print(f"batch {bs:4d}: {t * 1e3:8.2f} ms/step  {bs / t:9.1f} tokens/s")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(engine.runner.device), "dtype": str(engine.runner.dtype),
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
