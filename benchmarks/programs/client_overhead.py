"""Where the time of a program goes, client side vs server side: the multi-turn chat workload of
bench_programs.py as a DSL program (RuntimeEndpoint, native /generate) and as plain OpenAI-client calls
(/v1/chat/completions), alternating on one running server, the cache flushed before each run.

For each run: programs/s, the mean time of one HTTP call as the client sees it, the server's mean end-to-end
time per request (its /metrics histogram: from the request's admission after tokenization to its last token),
their difference (HTTP, JSON, tokenization and chat template in the server's HTTP process, and the client
library), the requests the server saw by route, and the prompt and cached tokens (the two clients must send
the same prompts).

    python benchmarks/programs/client_overhead.py --url http://127.0.0.1:30000 --programs 32 --threads 64 \\
        --repeats 5 --out /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_programs as bp  # noqa: E402

import radixlm as sgl  # noqa: E402


def scrape(url: str) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r'radixlm_http_requests_total\{.*route="([^"]+)",status="(\d+)"\} (\S+)', line)
        if m:
            out[f"{m[1]} {m[2]}"] = float(m[3])
        m = re.match(r"radixlm_e2e_request_latency_seconds_(sum|count)\{.*\} (\S+)", line)
        if m:
            out[f"e2e_{m[1]}"] = float(m[2])
    return out


def run(mode: str, url: str, args: list[dict], threads: int, backend, client, model) -> dict:
    calls: list[float] = []
    lock = threading.Lock()

    def timed(fn, *a, **kw):
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        with lock:
            calls.append(time.perf_counter() - t0)
        return r

    httpx.post(f"{url}/flush_cache", timeout=60)
    m0, s0 = scrape(url), bp.server_stats(url)
    t = time.perf_counter()
    if mode == "dsl":
        request = backend._request
        backend._request = lambda payload: timed(request, payload)
        try:
            states = bp.multi_turn.run_batch(args, backend=backend, num_threads=threads, temperature=0)
        finally:
            del backend._request
        failed = sum(s.error is not None for s in states)
    else:

        def one(a):
            msgs = [{"role": "system", "content": a["system"]}]
            for q in a["questions"]:
                msgs.append({"role": "user", "content": q})
                r = timed(
                    client.chat.completions.create,
                    model=model,
                    messages=msgs,
                    max_tokens=a["max_tokens"],
                    temperature=0,
                )
                msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})

        with ThreadPoolExecutor(threads) as pool:
            failed = sum(f.exception() is not None for f in [pool.submit(one, a) for a in args])
    secs = time.perf_counter() - t
    m1, s1 = scrape(url), bp.server_stats(url)
    d = {k: m1[k] - m0.get(k, 0) for k in m1 if m1[k] != m0.get(k, 0)}
    n = d.get("e2e_count", 0)
    client_ms = 1000 * statistics.mean(calls) if calls else float("nan")
    server_ms = 1000 * d["e2e_sum"] / n if n else float("nan")
    return {
        "mode": mode,
        "programs": len(args),
        "failed": failed,
        "seconds": secs,
        "programs_per_s": len(args) / secs,
        "client_calls": len(calls),
        "server_requests": n,
        "routes": {k: v for k, v in d.items() if not k.startswith("e2e")},
        "client_call_ms": client_ms,
        "server_e2e_ms": server_ms,
        "outside_scheduler_ms": client_ms - server_ms,
        "prompt_tokens": s1["prompt_tokens"] - s0["prompt_tokens"],
        "cached_tokens": s1["cached_tokens"] - s0["cached_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--programs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    system = "You are a careful assistant. " + bp.words(rng, 400)
    args = [
        {"system": system, "questions": [bp.words(rng, 10) + "?" for _ in range(4)], "max_tokens": a.max_tokens}
        for _ in range(a.programs)
    ]
    import openai

    backend = sgl.RuntimeEndpoint(a.url)
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="none")
    model = client.models.list().data[0].id
    for mode in ("dsl", "plain"):  # warm-up, untimed
        run(mode, a.url, args[:4], a.threads, backend, client, model)
    runs = []
    for rep in range(a.repeats):
        for mode in ("dsl", "plain") if rep % 2 == 0 else ("plain", "dsl"):
            r = run(mode, a.url, args, a.threads, backend, client, model)
            runs.append(r)
            print(
                f"{mode:>5}: {r['programs_per_s']:7.2f} prog/s  call {r['client_call_ms']:7.1f} ms  server e2e "
                f"{r['server_e2e_ms']:7.1f} ms  outside {r['outside_scheduler_ms']:6.1f} ms  requests "
                f"{r['server_requests']:.0f}  prompt {r['prompt_tokens']} cached {r['cached_tokens']}  "
                f"failed {r['failed']}",
                flush=True,
            )
    summary = {}
    for mode in ("dsl", "plain"):
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {
            k: statistics.median(r[k] for r in mine)
            for k in ("programs_per_s", "client_call_ms", "server_e2e_ms", "outside_scheduler_ms")
        }
        print(f"median {mode:>5}: " + "  ".join(f"{k} {v:.2f}" for k, v in summary[mode].items()))
    if a.out:
        Path(a.out).write_text(json.dumps({"config": vars(a), "median": summary, "runs": runs}, indent=2))
    backend.shutdown()
    client.close()


if __name__ == "__main__":
    main()
