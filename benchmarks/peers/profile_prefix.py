"""Why the shared-prefix serving workload trails the peer: the in-process Engine runs the same shape (8 groups x
1,500-token system prompt + 40-token question, 64 output tokens, 64 requests in flight) and records every
scheduler step's kind (extend or decode), size and wall time. A decode stream's inter-token gap is the time of the
steps between two of its tokens, so extend steps that carry no decode rows show up directly in ITL p99.

    python benchmarks/peers/profile_prefix.py TOKENIZER_DIR OUT.json [engine key=value ...]

`workload=random` runs the random serving shape instead (512-token prompts, 128 output tokens, 32 in flight).
"""
from __future__ import annotations

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
eng = radixlm.Engine(model_path="benchmarks/configs/llama-3.1-8b", load_format="dummy", tokenizer_path=tok,
                     log_level="warning", **extra)
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

pending, inflight, steps = list(prompts), 0, []
start = last = time.perf_counter()
while pending or inflight:
    while pending and inflight < concurrency:
        eng.add_request(input_ids=pending.pop(0), sampling_params=params)
        inflight += 1
    updates = eng.step()
    now = time.perf_counter()
    inflight -= sum(1 for u in updates if u["finished"])
    info = dict(eng.scheduler.last_step or {})
    info["ms"] = (now - last) * 1e3
    steps.append(info)
    last = now
total = time.perf_counter() - start


def summary(kind: str) -> dict:
    ms = [s["ms"] for s in steps if s.get("mode") == kind]
    toks = [s.get("tokens", 0) for s in steps if s.get("mode") == kind]
    if not ms:
        return {"steps": 0}
    q = statistics.quantiles(ms, n=100) if len(ms) > 1 else ms * 99
    return {"steps": len(ms), "ms_sum": sum(ms), "ms_mean": statistics.mean(ms), "ms_p50": q[49],
            "ms_p99": q[98], "ms_max": max(ms),
            "tokens_mean": statistics.mean(toks), "tokens_max": max(toks),
            "with_decode_riders": sum(1 for s in steps if s.get("mode") == kind and s.get("decode_riders"))}


n_out = len(prompts) * params["max_new_tokens"]
res = {"engine_args": extra, "workload": workload, "seconds": total, "output_tokens_per_s": n_out / total,
       "extend": summary("extend"), "decode": summary("decode"), "steps": steps}
print(f"{workload}: {total:.2f} s, {n_out / total:.0f} output tok/s; extend {res['extend']}; decode {res['decode']}")
json.dump(res, open(out, "w"), indent=1)
