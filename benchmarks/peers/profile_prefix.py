"""Why the shared-prefix serving workload trails the peer: the in-process Engine runs the same shape (8 groups x
1,500-token system prompt + 40-token question, 64 output tokens, 64 requests in flight) and records every
scheduler step's kind (extend or decode), size and wall time. A decode stream's inter-token gap is the time of the
steps between two of its tokens, so extend steps that carry no decode rows show up directly in ITL p99.

    python benchmarks/peers/profile_prefix.py TOKENIZER_DIR OUT.json [engine key=value ...]

`workload=random` runs the random serving shape instead (512-token prompts, 128 output tokens, 32 in flight);
`gc_ab=true` runs it a second time with Python's cyclic collector let back at everything alive (see below).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import time

import radixlm

tok, out = sys.argv[1], sys.argv[2]
extra = dict(kv.split("=", 1) for kv in sys.argv[3:])
extra = {k: {"true": True, "false": False}.get(v, v) for k, v in extra.items()}
extra = {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in extra.items()}
workload = extra.pop("workload", "prefix")
gc_ab = extra.pop("gc_ab", False)
model_path = extra.pop("model_path", "benchmarks/configs/llama-3.1-8b")
load_format = extra.pop("load_format", "dummy")
eng = radixlm.Engine(model_path=model_path, load_format=load_format, tokenizer_path=tok, log_level="warning", **extra)
rng = random.Random(0)
systems = [[rng.randrange(1000, 40000) for _ in range(1500)] for _ in range(8)]
prompts = [systems[i % 8] + [rng.randrange(1000, 40000) for _ in range(40)] for i in range(128)]
params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
concurrency = 64
if workload == "random":
    prompts = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(128)]
    params["max_new_tokens"], concurrency = 128, 32
eng.generate(input_ids=[p[:64] for p in prompts[:8]], sampling_params={**params, "max_new_tokens": 4})
eng.flush_cache()

gc_ms: dict[int, list[float]] = {0: [], 1: [], 2: []}
gc_start = [0.0]


def _gc_timer(phase: str, info: dict) -> None:  # how long the cyclic collector stalls the stepping thread
    if phase == "start":
        gc_start[0] = time.perf_counter()
    else:
        gc_ms[info["generation"]].append((time.perf_counter() - gc_start[0]) * 1e3)


def summary(steps: list[dict], kind: str) -> dict:
    ms = [s["ms"] for s in steps if s.get("mode") == kind]
    toks = [s.get("tokens", 0) for s in steps if s.get("mode") == kind]
    if not ms:
        return {"steps": 0}
    q = statistics.quantiles(ms, n=100) if len(ms) > 1 else ms * 99
    return {
        "steps": len(ms),
        "ms_sum": sum(ms),
        "ms_mean": statistics.mean(ms),
        "ms_p50": q[49],
        "ms_p99": q[98],
        "ms_max": max(ms),
        "tokens_mean": statistics.mean(toks),
        "tokens_max": max(toks),
        "with_decode_riders": sum(1 for s in steps if s.get("mode") == kind and s.get("decode_riders")),
    }


def run(label: str) -> dict:
    for v in gc_ms.values():
        v.clear()
    pending, inflight, steps = list(prompts), 0, []
    start = last = time.perf_counter()
    while pending or inflight:
        while pending and inflight < concurrency:
            eng.add_request(input_ids=pending.pop(0), sampling_params=params)
            inflight += 1
        updates = eng.step()
        now = time.perf_counter()
        inflight -= sum(1 for u in updates if u["finished"])
        info = eng.scheduler.last_step.as_dict() if eng.scheduler.last_step else {}
        info["ms"] = (now - last) * 1e3
        steps.append(info)
        last = now
    total = time.perf_counter() - start
    eng.flush_cache()
    n_out = len(prompts) * params["max_new_tokens"]
    res = {
        "run": label,
        "seconds": total,
        "output_tokens_per_s": n_out / total,
        "extend": summary(steps, "extend"),
        "decode": summary(steps, "decode"),
        "gc": {g: {"count": len(v), "ms_sum": sum(v), "ms_max": max(v, default=0)} for g, v in gc_ms.items()},
        "steps": steps,
    }
    print(
        f"{workload} {label}: {total:.2f} s, {n_out / total:.0f} output tok/s; extend {res['extend']}; "
        f"decode {res['decode']}; gc {res['gc']}",
        flush=True,
    )
    return res


gc.callbacks.append(_gc_timer)
# The scheduler froze everything alive at start-up out of the collector's reach; gc_ab=true also runs the same
# workload with that undone, to show what the collector costs a step.
runs = [run("gc frozen")]
if gc_ab:
    gc.unfreeze()
    runs.append(run("gc unfrozen"))
json.dump({"engine_args": extra, "workload": workload, "runs": runs}, open(out, "w"), indent=1)
