"""What the router adds to a request, without a model behind it: a stand-in worker (answers /v1/completions with a
fixed body, or a stream of N chunks, at once; /load and /health for the router's checks) in one process, the real
router (`radixlm.srt.router.app.create_app`, under uvicorn as `radixlm router` runs it) in another, and a client
timing requests straight to the stand-in and through the router, one at a time and C at a time.

    python tools/router_overhead.py [--requests 400] [--concurrency 1 16] [--chunks 32]

An instrument for the router's own cost (bench_router.py measures it beside real workers, where a CPU model's
latency hides it); prints p50 / p99 per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BODY = json.dumps(
    {
        "id": "cmpl-x",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": "Hi", "finish_reason": "length"}],
    }
).encode()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stand_in(port: int, chunks: int) -> None:
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"] == "/load":
            out, kind = (
                b'{"num_running": 0, "num_waiting": 0, "waiting_tokens": 0, "kv_used": 0, "kv_total": 1}',
                b"application/json",
            )
        elif scope["path"] == "/v1/completions" and b'"stream": true' in body:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for i in range(chunks):
                await send(
                    {
                        "type": "http.response.body",
                        "body": b'data: {"choices": [{"text": "t%d"}]}\n\n' % i,
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        else:
            out, kind = BODY, b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": out})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def _router(port: int, worker: str) -> None:
    from radixlm.srt.router.app import RouterConfig
    from radixlm.srt.router.launch import serve_router

    serve_router(RouterConfig(worker_urls=(worker,)), "127.0.0.1", port, "error")


async def _time(url: str, n: int, conc: int, stream: bool) -> list[float]:
    import aiohttp

    body = {"model": "m", "prompt": "Hello there", "max_tokens": 1, "stream": stream}
    lat: list[float] = []
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession() as s:

        async def one():
            async with sem:
                t = time.perf_counter()
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status == 200, r.status
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(one() for _ in range(min(20, n))))  # warm the connections
        lat.clear()
        await asyncio.gather(*(one() for _ in range(n)))
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--chunks", type=int, default=32, help="chunks per streamed answer")
    args = ap.parse_args()
    wp, rp = _port(), _port()
    procs = [mp.Process(target=_stand_in, args=(wp, args.chunks), daemon=True)]
    procs[0].start()
    worker = f"http://127.0.0.1:{wp}"
    procs.append(mp.Process(target=_router, args=(rp, worker), daemon=True))
    procs[1].start()
    router = f"http://127.0.0.1:{rp}"
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(router + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))] * 1e3  # noqa: E731
    head = ("mode", "conc", "direct p50/p99 ms", "router p50/p99 ms", "added p50 ms", "added mean")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (10, 4, 18, 18, 12, 10))))
    for stream in (False, True):
        for c in args.concurrency:
            d = asyncio.run(_time(worker, args.requests, c, stream))
            r = asyncio.run(_time(router, args.requests, c, stream))
            mode = "stream" if stream else "whole"
            direct, routed = f"{q(d, 0.5):.2f}/{q(d, 0.99):.2f}", f"{q(r, 0.5):.2f}/{q(r, 0.99):.2f}"
            added_mean = (statistics.mean(r) - statistics.mean(d)) * 1e3
            print(f"{mode:>10} {c:>4} {direct:>18} {routed:>18} {q(r, 0.5) - q(d, 0.5):12.2f} {added_mean:10.2f}")
    for p in procs:
        p.terminate()


if __name__ == "__main__":
    main()
