"""Offline throughput of the in-process Engine: all prompts submitted at once, `ignore_eos`, greedy.

Workloads (fixed seeds):
  random    N prompts of exactly --input-len random token ids, --output-len new tokens each;
  sharegpt  N prompts with ShareGPT-like lengths: input and output lengths drawn from log-normal
            distributions fitted to the ShareGPT conversation set (median ~ 220 in / 190 out, long tails),
            clipped to [4, 2048] and [4, 1024].

    python benchmarks/bench_offline.py --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --tokenizer-path TOK --workload random --num-prompts 256 --input-len 512 --output-len 256 \
        --out benchmarks/results/h100/offline_random.json
"""

from __future__ import annotations

import argparse
import platform
import time

import radixlm  # first: it sets OpenMP's passive wait before torch loads the runtime

# isort: split
import torch
from workloads import engine_kwargs, offline_report
from workloads import offline_workload as workload


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--workload", choices=("random", "sharegpt"), default="random")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("engine_args", nargs="*", help="extra Engine keywords as key=value (e.g. attention_backend=triton)")
    args = ap.parse_args()
    extra = engine_kwargs(args.engine_args)
    engine = radixlm.Engine(
        args.model_path, tokenizer_path=args.tokenizer_path, load_format=args.load_format, log_level="warning", **extra
    )
    data = workload(args, engine.runner.vocab_size)
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for _, n in data]
    warm = [p for p, _ in data[:8]]
    engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 4, "ignore_eos": True, "temperature": 0})
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=[p for p, _ in data], sampling_params=params)
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    offline_report(
        args,
        data,
        sum(len(o["output_ids"]) for o in outs),
        elapsed,
        attention_backend=engine.runner.attn_backend_name,
        cuda_graph=engine.runner.uses_cuda_graphs,
        overlap=engine.scheduler.overlap,
        device=torch.cuda.get_device_name() if engine.runner.device.type == "cuda" else platform.processor(),
        engine_args=extra,
        decode_steps=stats["decode_steps"],
        extend_steps=stats["extend_steps"],
        retractions=stats["retractions"],
    )


if __name__ == "__main__":
    main()
