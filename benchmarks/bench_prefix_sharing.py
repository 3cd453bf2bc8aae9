"""Prefix-sharing benchmark in the spirit of SGLang's generated-shared-prefix dataset.

Groups of requests share a long system prompt, each with its own question. All requests arrive at once (offline
throughput); we run the same workload with the radix cache on and off and report throughput, cache hit rate and
mean time-to-first-token. Writes JSON; `--plot` draws a bar chart if matplotlib is installed.

    python benchmarks/bench_prefix_sharing.py --groups 4 --per-group 8 --system-len 1000 --question-len 20
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from pathlib import Path

import radixlm  # first: it sets OpenMP's passive wait before torch loads the runtime

# isort: split
import torch


def make_workload(
    tokenizer_size: int, groups: int, per_group: int, system_len: int, question_len: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    lo = 100  # skip the special and byte tokens at the bottom of most vocabularies
    systems = [[rng.randrange(lo, tokenizer_size) for _ in range(system_len)] for _ in range(groups)]
    prompts = [
        s + [rng.randrange(lo, tokenizer_size) for _ in range(question_len)] for s in systems for _ in range(per_group)
    ]
    rng.shuffle(prompts)  # arrival order interleaves the groups
    return prompts


def run(engine, prompts: list[list[int]], warmup: list[list[int]], output_len: int) -> dict:
    sp = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    # Warm up on a same-shaped workload with other tokens: the first use of each kernel shape (CUDA lazy
    # loading, allocator growth) must not be billed to whichever configuration runs first.
    engine.generate(input_ids=warmup, sampling_params=sp)
    engine.flush_cache()
    base = engine.get_stats()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    rids = engine.add_request(input_ids=prompts, sampling_params=sp)
    ttft, done, out_tokens = {}, {}, 0
    while engine.has_unfinished_requests():
        for u in engine.step():
            rid = u["meta_info"]["id"]
            if rid not in ttft and u["output_ids"]:
                ttft[rid] = time.perf_counter() - start
            if u["finished"]:
                done[rid] = time.perf_counter() - start
                out_tokens += len(u["output_ids"])
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    in_tokens = sum(len(p) for p in prompts)
    return {
        "radix_cache": not engine.server_args.disable_radix_cache,
        "requests": len(rids),
        "wall_s": wall,
        "request_throughput": len(rids) / wall,
        "output_throughput": out_tokens / wall,
        "total_throughput": (in_tokens + out_tokens) / wall,
        "cache_hit_rate": (stats["cached_tokens"] - base["cached_tokens"])
        / (stats["prompt_tokens"] - base["prompt_tokens"]),
        "computed_prefill_tokens": stats["computed_prefill_tokens"] - base["computed_prefill_tokens"],
        "mean_ttft_s": statistics.mean(ttft.values()),
        "p50_ttft_s": statistics.median(ttft.values()),
        "mean_e2e_s": statistics.mean(done.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/prefix_sharing.json")
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()

    common = {
        k: v
        for k, v in dict(
            model_path=args.model_path,
            tokenizer_path=args.tokenizer_path,
            load_format=args.load_format,
            dtype=args.dtype,
            device=args.device,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            log_level="warning",
        ).items()
        if v is not None
    }
    rows = []
    for disable in (False, True):  # one engine at a time: each sizes its KV cache from free memory
        engine = radixlm.Engine(disable_radix_cache=disable, **common)
        vocab = min(len(engine.tokenizer), engine.loaded.config.vocab_size)
        device = str(engine.runner.device)
        shape = (args.groups, args.per_group, args.system_len, args.question_len)
        prompts = make_workload(vocab, *shape, args.seed)
        warmup = make_workload(vocab, *shape, args.seed + 1)
        rows.append(run(engine, prompts, warmup, args.output_len))
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    on, off = rows
    report = {
        "workload": {k: getattr(args, k) for k in ("groups", "per_group", "system_len", "question_len", "output_len")},
        "machine": {
            "device": device,
            "cuda": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "model": args.model_path or "SmolLM2-135M-Instruct (embedded)",
        "results": rows,
        "ratios": {
            "throughput_on_over_off": on["total_throughput"] / off["total_throughput"],
            "ttft_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{'radix':>6} {'req/s':>8} {'out tok/s':>10} {'tot tok/s':>10} {'hit rate':>9} {'mean TTFT':>10}")
    for r in rows:
        print(
            f"{str(r['radix_cache']):>6} {r['request_throughput']:8.2f} {r['output_throughput']:10.1f} "
            f"{r['total_throughput']:10.1f} {r['cache_hit_rate']:9.3f} {r['mean_ttft_s']:9.2f}s"
        )
    print(
        f"throughput x{report['ratios']['throughput_on_over_off']:.2f}, "
        f"TTFT /{report['ratios']['ttft_off_over_on']:.2f} with the radix cache; wrote {out}"
    )
    if args.plot:
        _plot(report, out.with_suffix(".png"))


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; skipping the plot")
        return
    rows = report["results"]
    labels = ["radix on" if r["radix_cache"] else "radix off" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].bar(labels, [r["total_throughput"] for r in rows])
    axes[0].set_title("total tokens/s")
    axes[1].bar(labels, [r["mean_ttft_s"] for r in rows])
    axes[1].set_title("mean TTFT (s)")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
