"""The router's HTTP front: the OpenAI and native generation routes, each request sent whole to one worker and its
answer passed back byte for byte (a stream chunk by chunk).

Faults: a request whose worker cannot be reached, fails (5xx) or dies before the first byte of the answer reached
the client is sent once more, to another worker; once bytes have reached the client nothing is resent (a stream
that breaks ends with an error event). A worker's 4xx (bad input) is passed through as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass

import aiohttp
import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlm.srt.router.policy import Policy, PolicyConfig
from radixlm.srt.router.prefix_index import block_names
from radixlm.srt.router.workers import WorkerSet

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
_HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive"}


@dataclass(frozen=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = ()
    policy: PolicyConfig = PolicyConfig()
    api_key: str | None = None
    health_interval_s: float = 1.0
    index_capacity: int = 1 << 18  # prefix blocks remembered per worker (~64 characters each)


def error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


def prompt_text(path: str, body) -> str:
    """The text whose prefix decides where a request goes: the chat messages in order (role and content), the
    completion prompt, or the native request's text or ids."""
    if not isinstance(body, dict):
        return ""
    if path == "/v1/chat/completions":
        parts, messages = [], body.get("messages")
        for m in messages if isinstance(messages, list) else []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"\x00{m.get('role')}\x01{content if isinstance(content, str) else ''}")
        return "".join(parts)
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("text", body.get("input_ids"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


class _Metrics:
    def __init__(self, workers: WorkerSet):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("radixlm_router_requests", "Requests sent to a worker", ["worker"], registry=r)
        self.retries = Counter("radixlm_router_retries", "Requests sent again after their worker failed", registry=r)
        self.failed = Counter(
            "radixlm_router_failed", "Requests answered with an error by the router itself", ["reason"], registry=r
        )
        self.matched = Histogram(
            "radixlm_router_prefix_match",
            "Fraction of each prompt the chosen worker was believed to hold",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        up = Gauge("radixlm_router_worker_up", "1 when the worker answers its health checks", ["worker"], registry=r)
        load = Gauge("radixlm_router_worker_load", "The router's load estimate (prompt tokens)", ["worker"], registry=r)
        self._up, self._load, self._workers = up, load, workers

    def render(self) -> bytes:
        for w in self._workers.workers.values():
            self._up.labels(w.url).set(1 if w.up else 0)
            self._load.labels(w.url).set(w.load())
        return generate_latest(self.registry)


class _KeyGuard:
    """The API key on every route but /health and /metrics. Plain ASGI: a wrapping `BaseHTTPMiddleware` would hide
    a client's disconnect from the route that waits for a worker's whole answer."""

    def __init__(self, app, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
            if dict(scope["headers"]).get(b"authorization") != self.want:
                refused = error(401, "invalid or missing API key", "invalid_request_error", "invalid_api_key")
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(cfg: RouterConfig) -> FastAPI:
    workers = WorkerSet(list(cfg.worker_urls), cfg.index_capacity, cfg.health_interval_s)
    policy = Policy(cfg.policy)
    metrics = _Metrics(workers)
    # Health checks and the admin routes go through httpx; the generation routes through aiohttp, whose client
    # costs a fraction of httpx's per request and per chunk (tools/router_overhead.py). No read timeout on either:
    # a generation may take minutes; connecting to a worker must be quick.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )
    relay: dict[str, aiohttp.ClientSession] = {}  # made inside the server's event loop (lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        relay["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            auto_decompress=False,  # bytes pass through as the worker wrote them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        watcher = asyncio.create_task(workers.watch(client))
        try:
            yield
        finally:
            watcher.cancel()
            await client.aclose()
            await relay["session"].close()

    async def _post(url: str, raw: bytes, headers: dict) -> aiohttp.ClientResponse:
        return await relay["session"].post(url, data=raw, headers=headers)

    def _let_go(up: aiohttp.ClientResponse) -> None:
        """An answer read to its end gives its connection back to the pool; one left unread (the client hung up,
        the worker broke off) is closed, which aborts the request at its worker."""
        if up.content.is_eof():
            up.release()
        else:
            up.close()

    app = FastAPI(title="radixlm router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.workers, app.state.policy = workers, policy

    if cfg.api_key is not None:
        app.add_middleware(_KeyGuard, key=cfg.api_key)

    # --- generation -----------------------------------------------------------------------------------------
    async def route(request: Request, path: str):
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None  # a worker answers it as it answers any broken body
        text = prompt_text(path, body)
        names, tokens = block_names(text), max(1, len(text) // 4)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        tried: set[str] = set()
        for attempt in range(2):
            try:
                choice = policy.choose(workers.healthy(), names, len(text), frozenset(tried))
            except LookupError:
                metrics.failed.labels("no_worker").inc()
                return error(503, "no worker is available to take the request", "server_error", "no_worker")
            w = choice.worker
            tried.add(w.url)
            metrics.requests.labels(w.url).inc()
            metrics.matched.observe(choice.matched)
            rid = workers.opened(w, tokens)
            done = True
            try:
                up = await _unless_gone(request, _post(w.url + path, raw, headers))
            except aiohttp.ClientError:
                workers.closed(w, rid)
                workers.failed(w)
                metrics.retries.inc()
                continue
            if up is None:  # the client hung up before the worker answered: dropping the request aborts it there
                workers.closed(w, rid)
                return Response(status_code=499)
            try:
                if up.status >= 500 and attempt == 0:
                    await up.read()
                    metrics.retries.inc()
                    continue
                kind = up.headers.get("content-type", "application/json")
                if "text/event-stream" not in kind:
                    content = await _unless_gone(request, up.read())
                    if content is None:  # the client hung up: closing the worker's answer aborts it there
                        return Response(status_code=499)
                    return Response(content, up.status, media_type=kind)
                chunks = up.content.iter_any()
                first = await anext(chunks, b"")
                done = False  # the stream owns the worker's answer from here
                return StreamingResponse(_relay(first, chunks, up, w, rid), status_code=up.status, media_type=kind)
            except aiohttp.ClientError:  # the worker died before any byte reached the client
                workers.failed(w)
                metrics.retries.inc()
                continue
            finally:
                if done:
                    _let_go(up)
                    workers.closed(w, rid)
        metrics.failed.labels("workers_failed").inc()
        return error(502, "the request failed on two workers", "server_error", "workers_failed")

    async def _unless_gone(request: Request, work):
        """`work`'s result, or None once the client has disconnected (checked twice a second while waiting; the
        work is then cancelled, which closes its connection to the worker)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task

    async def _relay(first: bytes, chunks, up: aiohttp.ClientResponse, w, rid: int):
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except aiohttp.ClientError:
            workers.failed(w)
            metrics.failed.labels("stream_broken").inc()
            msg = {"error": {"message": "the worker serving this stream failed", "type": "server_error",
                             "param": None, "code": "worker_failed"}}  # fmt: skip
            yield b"data: " + orjson.dumps(msg) + b"\n\ndata: [DONE]\n\n"
        finally:
            _let_go(up)
            workers.closed(w, rid)

    for path in GENERATION_ROUTES:

        async def handler(request: Request, path: str = path):
            return await route(request, path)

        app.add_api_route(path, handler, methods=["POST"])

    # --- the rest ---------------------------------------------------------------------------------------------
    async def from_any(path: str) -> Response:
        for w in workers.healthy():
            try:
                r = await client.get(w.url + path, timeout=10)
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return error(503, "no worker is available", "server_error", "no_worker")

    @app.get("/v1/models")
    async def models():
        return await from_any("/v1/models")

    @app.get("/get_model_info")
    async def model_info():
        return await from_any("/get_model_info")

    @app.get("/health")
    async def health():
        if not workers.healthy():
            return error(503, "no worker is up", "server_error", "no_worker")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        """A one-token generation on every worker that is up: 200 when each answers it, else 503 naming those
        that did not."""
        up = workers.healthy()

        async def one(w) -> bool:
            try:
                return (await client.get(w.url + "/health_generate", timeout=60)).status_code == 200
            except httpx.HTTPError:
                return False

        ok = await asyncio.gather(*(one(w) for w in up))
        failed = [w.url for w, good in zip(up, ok) if not good]
        if not up or failed:
            return error(503, f"generation failed on {failed or 'no worker'}", "server_error", "no_worker")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def to_all(path: str, body: bytes) -> list[tuple[str, int, object]]:
        async def one(w):
            try:
                r = await client.post(w.url + path, content=body, timeout=30)
                return w.url, r.status_code, r.json()
            except (httpx.HTTPError, ValueError) as e:
                return w.url, 503, {"error": type(e).__name__}

        return list(await asyncio.gather(*(one(w) for w in workers.healthy())))

    @app.post("/flush_cache")
    async def flush_cache():
        results = await to_all("/flush_cache", b"")
        for w in workers.workers.values():
            w.index.clear()
        ok = all(code == 200 for _, code, _ in results)
        return JSONResponse({"success": ok, "workers": {u: body for u, _, body in results}}, 200 if ok else 400)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        results = await to_all("/abort_request", await request.body())
        aborted = [rid for _, code, body in results if code == 200 for rid in body.get("aborted", [])]
        return {"success": bool(aborted), "aborted": aborted}

    @app.get("/get_server_info")
    async def server_info():
        async def one(w):
            try:
                return (await client.get(w.url + "/get_server_info", timeout=10)).json()
            except (httpx.HTTPError, ValueError):
                return None

        healthy = workers.healthy()
        infos = await asyncio.gather(*(one(w) for w in healthy))
        return {"router": _state(), "workers": {w.url: info for w, info in zip(healthy, infos)}}

    def _state() -> dict:
        return {
            "policy": asdict(cfg.policy),
            "workers": [
                {
                    "url": w.url,
                    "up": w.up,
                    "load": w.load(),
                    "sent": w.sent,
                    "open": len(w.open),
                    "report": asdict(w.report),
                    "index_blocks": len(w.index),
                }  # fmt: skip
                for w in workers.workers.values()
            ],
        }

    # --- workers at run time ----------------------------------------------------------------------------------
    def admin_refused() -> JSONResponse | None:
        if cfg.api_key is None:
            return error(403, "start the router with --api-key to add or remove workers at run time",
                         "invalid_request_error", "admin_disabled")  # fmt: skip
        return None

    @app.get("/workers")
    async def list_workers():
        return _state()

    @app.post("/workers")
    async def add_worker(request: Request):
        refused = admin_refused()
        if refused is not None:
            return refused
        try:
            url = orjson.loads(await request.body())["url"]
            w = workers.add(url)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            return error(400, f'body must be {{"url": "http://host:port"}} ({e})', "invalid_request_error")
        await workers.check(client, w)
        return {"success": True, "url": w.url, "up": w.up}

    @app.delete("/workers")
    async def remove_worker(request: Request):
        refused = admin_refused()
        if refused is not None:
            return refused
        try:
            url = orjson.loads(await request.body())["url"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as e:
            return error(400, f'body must be {{"url": "http://host:port"}} ({e})', "invalid_request_error")
        if not workers.remove(url):
            return error(404, f"no worker {url!r}", "not_found", "not_found")
        return {"success": True}

    app.state.started = time.time()
    return app
