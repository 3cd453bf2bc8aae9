"""One streamed completion at a time against a running server: per-chunk arrival gaps and tokens per chunk.

    python benchmarks/gpu/stream_probe.py http://127.0.0.1:30000 MODEL
"""
import json
import statistics
import sys
import time

import httpx

url, model = sys.argv[1], sys.argv[2]
for run in range(2):
    body = {"model": model, "prompt": "hello " * 500, "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    stamps, texts, usage = [], [], None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])
                if c["choices"]:
                    stamps.append(time.perf_counter() - t0)
                    texts.append(c["choices"][0]["text"])
                usage = c.get("usage") or usage
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"run {run}: chunks {len(stamps)} tokens {usage and usage['completion_tokens']} "
          f"first {stamps[0] * 1e3:.0f} ms, gap median {statistics.median(gaps) * 1e3:.1f} ms "
          f"max {max(gaps) * 1e3:.1f} ms, total {stamps[-1] * 1e3:.0f} ms")
