"""Prompt sets shared by our benchmarks and the peer runners (benchmarks/peers/), so that both engines get exactly
the same token ids. Standard library only: the peer's Python environment imports it too."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path


def offline_workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    lo, hi = 1000, min(vocab, 40000) - 1  # ordinary tokens, away from special ids at either end
    out = []
    for _ in range(args.num_prompts):
        if args.workload == "random":
            n_in, n_out = args.input_len, args.output_len
        else:
            n_in = int(min(2048, max(4, rng.lognormvariate(math.log(220), 1.1))))
            n_out = int(min(1024, max(4, rng.lognormvariate(math.log(190), 0.9))))
        out.append(([rng.randrange(lo, hi) for _ in range(n_in)], n_out))
    return out


def offline_report(
    args, data: list[tuple[list[int], int]], n_out: int, elapsed: float, label: str = "", **fields
) -> dict:
    """The result of one offline run of `data` (checked: every request produced exactly its output length),
    printed as one line and written to args.out; `fields` add the engine's own facts."""
    n_in = sum(len(p) for p, _ in data)
    assert n_out == sum(n for _, n in data), "every request must produce exactly its output length"
    result = {
        "workload": args.workload,
        "num_prompts": len(data),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "seconds": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "requests_per_s": len(data) / elapsed,
        **fields,
    }
    print(
        f"{label}{args.workload}: {len(data)} prompts, {n_in} in / {n_out} out tokens in {elapsed:.1f} s = "
        f"{n_out / elapsed:.0f} output tok/s ({(n_in + n_out) / elapsed:.0f} total tok/s)"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def engine_kwargs(pairs: list[str]) -> dict:
    """Extra Engine keywords from `key=value` command-line words: numbers as int or float, true/false as bools."""
    out = {}
    for kv in pairs:
        k, v = kv.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), _number(v))
    return out


def _number(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v
