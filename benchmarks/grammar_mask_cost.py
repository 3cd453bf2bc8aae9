"""Host cost of grammar-constrained decoding per step: every constrained request fills its row of the token
bitmask and accepts its sampled token on the CPU, in the scheduler's loop, once per step. This times the
backends on the serving benchmark's JSON schema (`bench_serving.JSON_SCHEMA`) with N requests walking the
grammar at once (each step: fill every row, then accept a random allowed token per request), as a step of a
batch of N constrained requests does.

    python benchmarks/grammar_mask_cost.py --tokenizer DIR [--requests 64] [--steps 96] [--out cost.json]

With the full-vocabulary stand-in of the GPU runs (`benchmarks/gpu/full_vocab_tokenizer.py`, 128,256 ids) it
shows what the H100 JSON-schema workload pays on the host per decode step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_schema_coverage import pct  # noqa: E402
from benchmarks.bench_serving import JSON_SCHEMA  # noqa: E402
from radixlm.srt.constrained.base import GrammarSpec  # noqa: E402
from radixlm.srt.constrained.bitmask import allocate, allowed_ids  # noqa: E402
from radixlm.srt.constrained.manager import create_backend  # noqa: E402


def pick(ids: list[int], stop_ids: list[int], rng: random.Random) -> int:
    """A random allowed token; a stop token only when the grammar allows nothing else."""
    non_stop = [t for t in ids if t not in stop_ids] if len(ids) < 4096 else None
    if non_stop is None:  # most of the vocabulary is allowed: one draw (a stop id is a few in 128k)
        return rng.choice(ids)
    return rng.choice(non_stop) if non_stop else stop_ids[0]


def run(backend_name: str, tokenizer, vocab: int, stop_ids: list[int], n: int, steps: int, seed: int) -> dict:
    backend = create_backend(backend_name, tokenizer, vocab, stop_ids)
    spec = GrammarSpec("json_schema", json.dumps(JSON_SCHEMA, sort_keys=True))
    t0 = time.perf_counter()
    compiled = backend.compile(spec)
    compile_s = time.perf_counter() - t0
    matchers = [compiled.matcher() for _ in range(n)]
    mask = allocate(n, vocab, pin=False)
    rng = random.Random(seed)
    scratch = allocate(n, vocab, pin=False)
    fill_us, batch_ms, accept_us, step_ms = [], [], [], []
    live = list(range(n))
    for _ in range(steps):
        if not live:
            break
        for i in live:  # one row at a time, for the per-row cost
            t = time.perf_counter()
            matchers[i].fill_mask(scratch, i)
            fill_us.append((time.perf_counter() - t) * 1e6)
        mask.fill_(-1)
        t_step = time.perf_counter()
        type(matchers[0]).fill_masks([(matchers[i], i) for i in live], mask)  # as the scheduler fills a batch
        fill_done = time.perf_counter()
        batch_ms.append((fill_done - t_step) * 1e3)
        picks = {}
        for i in live:  # choosing the token stands in for sampling on the device: not timed
            picks[i] = pick(allowed_ids(mask, i, vocab), stop_ids, rng)
        t_acc = time.perf_counter()
        for i in live:  # the scheduler accepts each token and asks whether the grammar is complete
            t = time.perf_counter()
            matchers[i].accept(picks[i])
            matchers[i].is_terminated()
            accept_us.append((time.perf_counter() - t) * 1e6)
        step_ms.append(((fill_done - t_step) + (time.perf_counter() - t_acc)) * 1e3)
        live = [i for i in live if not matchers[i].is_terminated()]
    return {
        "backend": backend_name,
        "requests": n,
        "steps": len(step_ms),
        "compile_s": round(compile_s, 3),
        "fill_us": {
            "p50": round(pct(fill_us, 50), 1),
            "p99": round(pct(fill_us, 99), 1),
            "mean": round(statistics.mean(fill_us), 1),
        },
        "batch_fill_ms": {"p50": round(pct(batch_ms, 50), 2), "p99": round(pct(batch_ms, 99), 2)},
        "accept_us": {"p50": round(pct(accept_us, 50), 1), "p99": round(pct(accept_us, 99), 1)},
        "host_ms_per_step": {
            "p50": round(pct(step_ms, 50), 2),
            "p99": round(pct(step_ms, 99), 2),
            "mean": round(statistics.mean(step_ms), 2),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backends", nargs="+", default=["llguidance", "xgrammar", "outlines"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok)
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else [0]
    rows = [run(b, tok, vocab, stop_ids, args.requests, args.steps, args.seed) for b in args.backends]
    print(f"vocabulary {vocab}, {args.requests} constrained requests")
    print(
        f"{'backend':>10} {'compile s':>9} {'row fill us p50/p99':>20} {'batch fill ms p50/p99':>22} "
        f"{'accept us p50':>13} {'host ms/step p50/p99':>21}"
    )
    for r in rows:
        print(
            f"{r['backend']:>10} {r['compile_s']:>9} {r['fill_us']['p50']:>10}/{r['fill_us']['p99']:<9} "
            f"{r['batch_fill_ms']['p50']:>12}/{r['batch_fill_ms']['p99']:<9} "
            f"{r['accept_us']['p50']:>13} {r['host_ms_per_step']['p50']:>10}/{r['host_ms_per_step']['p99']}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"vocab": vocab, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
