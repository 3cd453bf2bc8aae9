"""The router per policy: throughput, TTFT and cache hit rate on a shared-prefix and a random workload, and the
router's own overhead per request against a direct connection to a worker.

Starts `--workers` servers (the same flags each, `--worker-args`), then one router per policy over them; each
workload runs through benchmarks/bench_serving.py (streaming, EOS banned). Hit rate: cached prompt tokens over
prompt tokens, summed over the workers, across that run (caches flushed before it). JSON to --out, a table on
stdout, and with --plot a bar chart.

    python benchmarks/bench_router.py --workers 3 --worker-args "--quantization none" \\
        --out benchmarks/results/cpu-2core-avx2/router/router.json \\
        --plot benchmarks/results/cpu-2core-avx2/router/router.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
WORKLOADS = {
    "shared-prefix": ["--dataset", "shared-prefix", "--groups", "8", "--system-len", "400", "--input-len", "20",
                      "--num-prompts", "64", "--output-len", "16", "--max-concurrency", "8"],
    "random": ["--dataset", "random", "--num-prompts", "48", "--input-len", "200", "--output-len", "16",
               "--max-concurrency", "8"],
}  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, procs, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a process exited while {url} started")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not come up")


def _hits(urls: list[str]) -> tuple[int, int]:
    cached = prompt = 0
    for u in urls:
        s = httpx.get(f"{u}/get_server_info", timeout=60).json()["scheduler"]
        cached, prompt = cached + s["cached_tokens"], prompt + s["prompt_tokens"]
    return cached, prompt


def _overhead(router: str, worker: str, n: int = 40) -> dict:
    """Latency of a one-token completion through the router minus straight to a worker, request by request."""
    body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    lat = {}
    with httpx.Client(timeout=60) as c:
        for name, url in (("direct", worker), ("router", router)):
            for _ in range(5):
                c.post(f"{url}/v1/completions", json=body)
            times = []
            for _ in range(n):
                t = time.perf_counter()
                c.post(f"{url}/v1/completions", json=body).raise_for_status()
                times.append(time.perf_counter() - t)
            lat[name] = sorted(times)
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))] * 1e3  # noqa: E731
    return {
        "direct_p50_ms": q(lat["direct"], 0.5),
        "router_p50_ms": q(lat["router"], 0.5),
        "direct_p99_ms": q(lat["direct"], 0.99),
        "router_p99_ms": q(lat["router"], 0.99),
        "added_p50_ms": q(lat["router"], 0.5) - q(lat["direct"], 0.5),
        "added_mean_ms": (statistics.mean(lat["router"]) - statistics.mean(lat["direct"])) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--worker-args", default="", help="more flags for each worker (radixlm serve)")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin", "least_load", "random"])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and not args.worker_args.count("--device cuda"):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.workers))
    ports = [_port() for _ in range(args.workers)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixlm.launch_server",
                "--port",
                str(p),
                "--log-level",
                "warning",
                *shlex.split(args.worker_args),
            ],
            env=env,
        )  # fmt: skip
        for p in ports
    ]
    rows, overhead = [], None
    try:
        for u in urls:
            _wait(u, workers)
        for policy in args.policies:
            port = _port()
            cmd = [sys.executable, "-m", "radixlm.cli", "router", "--port", str(port), "--policy", policy,
                   "--log-level", "warning", "--worker-urls", *urls]  # fmt: skip
            router = subprocess.Popen(cmd)
            rurl = f"http://127.0.0.1:{port}"
            try:
                _wait(rurl, [router])
                if overhead is None:
                    overhead = _overhead(rurl, urls[0])
                for wl in args.workloads:
                    httpx.post(f"{rurl}/flush_cache", timeout=60)
                    c0, p0 = _hits(urls)
                    with tempfile.NamedTemporaryFile(suffix=".json") as f:
                        subprocess.run([sys.executable, str(HERE / "bench_serving.py"), "--base-url", rurl,
                                        "--label", f"{policy}-{wl}", "--out", f.name, *WORKLOADS[wl]],
                                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
                        rep = json.loads(Path(f.name).read_text())
                    c1, p1 = _hits(urls)
                    rows.append({
                        "policy": policy, "workload": wl, "hit_rate": (c1 - c0) / max(1, p1 - p0),
                        "output_throughput": rep["output_throughput"], "request_throughput": rep["request_throughput"],
                        "ttft_p50_ms": rep["ttft_ms"]["p50"], "ttft_p99_ms": rep["ttft_ms"]["p99"],
                        "duration_s": rep["duration_s"], "completed": rep["completed"], "failed": rep["failed"],
                    })  # fmt: skip
                    r = rows[-1]
                    print(f"{policy:>12} {wl:>14}: hit {r['hit_rate']:.2f}  {r['request_throughput']:.2f} req/s  "
                          f"{r['output_throughput']:.1f} out tok/s  TTFT p50 {r['ttft_p50_ms']:.0f} ms p99 "
                          f"{r['ttft_p99_ms']:.0f} ms  ok {r['completed']} failed {r['failed']}",
                          flush=True)  # fmt: skip
            finally:
                router.send_signal(signal.SIGINT)
                router.wait(timeout=30)
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            w.wait(timeout=60)
    print(f"router overhead per request: {json.dumps(overhead)}")
    out = {"machine": platform.node(), "processor": platform.processor(), "workers": args.workers,
           "worker_args": args.worker_args, "rows": rows, "overhead": overhead}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, label in ((axes[0], "request_throughput", "requests/s"), (axes[1], "hit_rate", "cache hit rate")):
            for i, wl in enumerate(args.workloads):
                vals = [next(r[key] for r in rows if r["policy"] == p and r["workload"] == wl) for p in args.policies]
                ax.bar([j + 0.4 * i for j in range(len(args.policies))], vals, width=0.4, label=wl)
            ax.set_xticks([j + 0.2 for j in range(len(args.policies))], args.policies, fontsize=8)
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        fig.suptitle(f"{args.workers} workers behind the router ({args.worker_args or 'defaults'})", fontsize=9)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
