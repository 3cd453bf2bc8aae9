"""`radixlm router --worker-urls URL...`: the router alone, over workers started elsewhere; and `radixlm serve
--dp-size N`: N workers on this host (one per GPU, or per tp_size GPUs; CPU processes splitting the cores) behind
a router on --port, in one command."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from radixlm._net import free_local_port
from radixlm.srt.router.policy import POLICIES, PolicyConfig
from radixlm.srt.utils import configure_logging

logger = logging.getLogger("radixlm.router")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="cache_aware", choices=POLICIES, help="how a request's worker is chosen")
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: the share of a prompt a worker must hold to get it regardless of load",
    )
    p.add_argument(
        "--balance-abs",
        type=float,
        default=4096.0,
        help="cache_aware: a holder may be this many prompt tokens busier than the least loaded worker",
    )
    p.add_argument("--balance-rel", type=float, default=1.5, help="cache_aware: ... or this many times as busy")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between a worker's health checks")
    p.add_argument("--index-capacity", type=int, default=1 << 18,
                   help="prefix blocks (~64 characters each) remembered per worker")  # fmt: skip


def router_config(ns: argparse.Namespace, urls: list[str], api_key: str | None):
    from radixlm.srt.router.app import RouterConfig

    policy = PolicyConfig(ns.policy, ns.cache_threshold, ns.balance_abs, ns.balance_rel)
    return RouterConfig(tuple(urls), policy, api_key, ns.health_interval, ns.index_capacity)


def serve_router(cfg, host: str, port: int, log_level: str) -> None:
    import uvicorn

    from radixlm.srt.router.app import create_app

    logger.info("router on http://%s:%d over %d workers, policy %s", host, port, len(cfg.worker_urls), cfg.policy.name)
    uvicorn.run(create_app(cfg), host=host, port=port, log_level=log_level.lower(), access_log=False,
                timeout_graceful_shutdown=5)  # fmt: skip


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="radixlm router", description="One endpoint over many radixlm workers.")
    p.add_argument("--worker-urls", nargs="*", default=[], help="http://host:port of each worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="required of clients, and for adding or removing workers")
    p.add_argument("--log-level", default="info")
    add_router_args(p)
    ns = p.parse_args(argv)
    configure_logging(ns.log_level, "[router] ")
    serve_router(router_config(ns, ns.worker_urls, ns.api_key), ns.host, ns.port, ns.log_level)


# --- data parallelism on one host ----------------------------------------------------------------------------------
def replica_env(i: int, dp: int, tp: int, device: str, gpus: int, cpus: int) -> dict[str, str]:
    """Replica i's environment: its own GPUs (tp of them), or its share of the CPUs."""
    env = dict(os.environ)
    if gpus and device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(i * tp, (i + 1) * tp))
    elif "OMP_NUM_THREADS" not in os.environ:  # the operator's setting wins
        env["OMP_NUM_THREADS"] = str(max(1, cpus // dp))
    return env


def run_data_parallel(argv: list[str], args) -> int:
    """`radixlm serve ... --dp-size N`: N workers (the same flags, --dp-size 1, each on a free local port), then the
    router on --host:--port (a worker that dies is only marked down). Ends them all when the router ends."""
    from radixlm.srt.cpu_threads import usable_cpus

    gpus = 0
    if args.device != "cpu":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and gpus < args.dp_size * args.tp_size:
            raise SystemExit(
                f"--dp-size {args.dp_size} x --tp-size {args.tp_size} needs that many GPUs; {gpus} visible"
            )
    base = _strip(argv, ("--dp-size", "--port", "--host", "--api-key", "--policy", "--cache-threshold",
                         "--balance-abs", "--balance-rel", "--health-interval", "--index-capacity"))  # fmt: skip
    ports = [free_local_port() for _ in range(args.dp_size)]
    procs = []
    for i, port in enumerate(ports):
        cmd = [sys.executable, "-m", "radixlm.launch_server", *base, "--host", "127.0.0.1", "--port", str(port)]
        env = replica_env(i, args.dp_size, args.tp_size, args.device, gpus, usable_cpus())
        procs.append(subprocess.Popen(cmd, env=env))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        _wait_healthy(urls, procs)
        ns = argparse.Namespace(policy=args.router_policy, cache_threshold=0.5, balance_abs=4096.0, balance_rel=1.5,
                                health_interval=1.0, index_capacity=1 << 18)  # fmt: skip
        serve_router(router_config(ns, urls, args.api_key), args.host, args.port, args.log_level)
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _wait_healthy(urls: list[str], procs: list, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        for url, p in zip(urls, procs):
            if p.poll() is not None:
                raise SystemExit(f"worker {url} exited with {p.returncode} during start-up")
        for url in list(pending):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise SystemExit(f"workers {sorted(pending)} did not become healthy in {timeout_s:.0f} s")
        time.sleep(0.3)
