"""The FastAPI app: native routes (/generate, /health, ...), the OpenAI routes, auth, limits and error bodies.

Every error leaves as an OpenAI-shaped body {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm.srt.entrypoints.openai.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ProfileRequest,
    request_error,
)
from radixlm.srt.entrypoints.openai.serving import (
    SSE_DONE,
    JSONResponse,
    OpenAIServing,
    RequestFailed,
    raise_if_failed,
    sse,
)
from radixlm.srt.errors import InvalidRequest, RadixLMError
from radixlm.srt.managers.request_prep import PreparedInput, check_logprob_args, normalize_inputs, per_prompt_params
from radixlm.srt.managers.tokenizer_manager import ServiceUnavailable, TokenizerManager

logger = logging.getLogger(__name__)


_GRAMMAR_KEYS = {"json_schema", "regex", "ebnf"}


class _HTTPError(RadixLMError):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
        super().__init__(message, param)
        self.status, self.type, self.code = status, type_, code


def error_response(err: RadixLMError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status)


async def read_json(request: Request, limit: int, empty=None):
    """The body as JSON: 413 past `limit` bytes, 400 for bytes that are not UTF-8, 422 for broken JSON; an empty
    body is `empty` where that is given (a POST whose arguments are all optional), else broken JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _HTTPError(
            413,
            f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes",
            "invalid_request_error",
            "request_too_large",
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _HTTPError(
                413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error", "request_too_large"
            )
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip() and empty is not None:
        return empty
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:  # orjson refuses lone surrogate escapes; the stdlib parses them and validation rejects them by field
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise _HTTPError(400, "request body is not valid UTF-8", "invalid_request_error", "invalid_encoding") from None
    except json.JSONDecodeError as e:
        raise _HTTPError(422, f"malformed JSON body: {e}", "invalid_request_error", "malformed_json") from None
    except RecursionError:  # orjson stops at 1024 levels; the stdlib runs out of stack
        raise _HTTPError(
            400, "JSON body nests objects and arrays too deeply", "invalid_request_error", "malformed_json"
        ) from None


def parse(model: type[BaseModel], data) -> BaseModel:
    """The body as `model`; an unknown or unsupported field, or a bad value, is a 400 naming it (protocol.py)."""
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object", param=None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise request_error(model, e) from None


def logprobs_with_text(meta: dict, decode: Callable[[int], str]) -> dict:
    """SGLang's return_text_in_logprobs: each (logprob, token id) entry of meta_info gains the token's text."""
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in meta:
            meta[key] = [(lp, tid, decode(tid)) for lp, tid in meta[key]]
    if "output_top_logprobs" in meta:
        meta["output_top_logprobs"] = [
            None if top is None else [(lp, tid, decode(tid)) for lp, tid in top] for top in meta["output_top_logprobs"]
        ]
    return meta


class _Guard:
    """API-key check and per-route request metrics, as plain ASGI: Starlette's `@app.middleware("http")` would
    pass every streamed chunk through an extra task and memory stream, which costs the HTTP process a
    noticeable share of its time per token at high concurrency."""

    def __init__(self, app, api_key: str | None, metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key and path != "/health":
            headers = dict(reversed(scope["headers"]))  # the first of repeated headers wins, as in Starlette
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.api_key}" and headers.get(b"x-api-key", b"").decode("latin-1") != self.api_key:
                self.metrics.http(path, 401)
                return await error_response(
                    _HTTPError(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
                )(scope, receive, send)
        status = 500  # what the server's error handler answers if the app raises before it starts a response

        async def send_seen(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        finally:
            self.metrics.http(path if status != 404 else "unknown", status)


def create_app(
    tm: TokenizerManager,
    args,
    info: dict,
    served_model_name: str,
    model_path: str,
    children_alive: Callable[[], bool],
    lifespan=None,
) -> FastAPI:
    app = FastAPI(title="radixlm", lifespan=lifespan, docs_url=None, redoc_url=None)
    openai = OpenAIServing(tm, served_model_name, model_path)
    limit = int(args.max_request_body_mb * (1 << 20))
    metrics = tm.metrics

    app.add_middleware(_Guard, api_key=args.api_key, metrics=tm.metrics)

    @app.exception_handler(RadixLMError)
    async def radix_error(_request, exc: RadixLMError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            _HTTPError(exc.status_code, str(exc.detail), kind, kind if exc.status_code == 404 else None)
        )

    @app.exception_handler(Exception)
    async def crash(_request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(
            _HTTPError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error")
        )

    # --- health and info -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if tm.dead or not children_alive():
            return error_response(ServiceUnavailable(tm.dead or "a server process is not running"))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        if tm.dead or not children_alive():
            return error_response(ServiceUnavailable(tm.dead or "a server process is not running"))
        params = per_prompt_params({"max_new_tokens": 1, "temperature": 0}, 1)[0]
        states = tm.submit([PreparedInput([tm.eos_ids[0] if tm.eos_ids else 0], None, params)])
        try:
            await asyncio.wait_for(tm.wait(states, request), timeout=30)
            raise_if_failed(states)
        except (asyncio.TimeoutError, RadixLMError) as e:
            return error_response(ServiceUnavailable(f"generation check failed: {e or 'timeout'}"))
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": model_path,
            "served_model_name": served_model_name,
            "tokenizer_path": info.get("tokenizer_path"),
            "is_generation": True,
            "architecture": info["architecture"],
            "context_length": info["context_length"],
            "vocab_size": info["vocab_size"],
            "dtype": info["dtype"],
            "device": info["device"],
            "quantization": info.get("quantization"),
            # the frontend language renders role blocks with it, as the chat route does
            "chat_template": getattr(tm.tokenizer, "chat_template", None),
        }

    @app.get("/get_server_info")
    async def server_info():
        stats = (await tm.control("get_stats")).payload
        metrics.set_scheduler_stats(stats)
        return {
            "server_args": asdict(args) | {"api_key": "***" if args.api_key else None},
            "scheduler": stats,
            "max_total_tokens": info["max_total_tokens"],
            "requests_in_flight": len(tm.states),
            "version": info.get("version"),
            "process_ids": info.get("process_ids"),
            "http_cpu_guard": tm.cpu_guard.state() if tm.cpu_guard is not None else None,
        }

    kv_seen: dict = {}  # the scheduler's last KV figures (/load answers even while a long step runs)

    @app.get("/load")
    async def load():
        """What a router weighs, from this process's own requests (those without a first token are queued or in
        prefill) and the scheduler's KV figures when it answers within half a second (else the last ones)."""
        if tm.dead or not children_alive():
            return error_response(ServiceUnavailable(tm.dead or "a server process is not running"))
        states = list(tm.states.values())
        pending = [st for st in states if st.first_token_at is None]
        stale = False
        try:
            stats = (await tm.control("get_stats", timeout=0.5)).payload
            kv_seen.update({k: stats[k] for k in ("kv_total", "kv_used", "kv_evictable")})
        except ServiceUnavailable:
            stale = True
        return {
            "num_waiting": len(pending),
            "waiting_tokens": sum(len(st.input_ids) for st in pending),
            "num_running": len(states) - len(pending),
            "requests_in_flight": len(states),
            "kv_total": kv_seen.get("kv_total", 0),
            "kv_used": kv_seen.get("kv_used", 0),
            "kv_evictable": kv_seen.get("kv_evictable", 0),
            "kv_stale": stale,
        }

    @app.post("/flush_cache")
    async def flush_cache():
        resp = await tm.control("flush_cache")
        if not resp.ok:
            raise _HTTPError(
                400, "cache not flushed: requests are running or waiting", "invalid_request_error", "requests_in_flight"
            )
        return {"success": True, "message": "Cache flushed."}

    @app.post("/start_profile")
    async def start_profile(request: Request):
        req = parse(ProfileRequest, await read_json(request, limit, empty={}))
        # the first start on a GPU sets up the profiler's CUDA tracing, which can take longer than a usual answer
        resp = await tm.control("start_profile", timeout=120, args=req.model_dump())
        if not resp.ok:
            raise _HTTPError(400, resp.payload, "invalid_request_error", "profile_not_started")
        return {"success": True, "message": "Profiling started.", **resp.payload}

    @app.post("/stop_profile")
    async def stop_profile():
        # writing the trace of a long profile takes a while: more than the usual control answer's 10 s
        resp = await tm.control("stop_profile", timeout=300)
        if not resp.ok:
            raise _HTTPError(400, resp.payload, "invalid_request_error", "profile_not_running")
        return {"success": True, "message": "Profile written.", **resp.payload}

    @app.get("/metrics")
    async def prometheus():
        try:
            metrics.set_scheduler_stats((await tm.control("get_stats", timeout=2)).payload)
        except ServiceUnavailable:
            pass  # still export what this process knows
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = parse(AbortRequest, await read_json(request, limit))
        rids = [r for r in list(tm.states) if r == req.rid or r.startswith(f"{req.rid}-")]
        for rid in rids:
            tm.abort(rid)
        return {"success": bool(rids), "aborted": rids}

    # --- native generation ---------------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request):
        req = parse(GenerateRequest, await read_json(request, limit))
        prompts, batched = normalize_inputs(req.text, req.input_ids)
        sp = req.sampling_params
        if any(isinstance(d, dict) and _GRAMMAR_KEYS & set(d) for d in (sp if isinstance(sp, list) else [sp])):

            def build():  # large schemas take tenths of a second to check: off the event loop (see OpenAIServing)
                ps = per_prompt_params(sp, len(prompts))
                for p in ps:
                    tm.check_grammar(p)
                return ps

            params = await tm.off_loop(build)
        else:
            params = per_prompt_params(sp, len(prompts))
        check_logprob_args(req.return_logprob, req.top_logprobs_num, req.logprob_start_len)
        inputs = [PreparedInput(*tok, sp) for tok, sp in zip(await tm.tokenize_many(prompts), params)]
        rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(inputs)
        if len(rids) != len(inputs):
            raise InvalidRequest(f"got {len(rids)} rids for {len(inputs)} prompts", param="rid")
        states = tm.submit(
            inputs,
            return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num,
            logprob_start_len=req.logprob_start_len,
            stream=req.stream,
            rids=rids,
        )
        many = batched or len(states) > 1

        def item(st, text: str, output_ids: list[int], meta: dict):
            if req.return_text_in_logprobs:
                meta = logprobs_with_text(meta, lambda tid: tm.tokenizer.decode([tid]))
            out = {"text": text, "output_ids": output_ids, "meta_info": meta}
            if many:
                out["index"] = st.index
            return out

        if req.stream:

            async def events():
                # Each chunk is the request as of its update (text and ids so far), not as the state is now: a
                # handler that lags behind may find the state further on, or finished, with updates still queued.
                text = {st.rid: "" for st in states}
                ids: dict[str, list[int]] = {st.rid: [] for st in states}
                async for st, out in tm.updates(states):
                    if out.failed:
                        yield sse(RequestFailed(out.finished_reason).to_dict())
                    elif out.delta or out.finished_reason or out.new_ids:
                        text[st.rid] += out.delta
                        ids[st.rid] += out.new_ids
                        yield sse(item(st, text[st.rid], list(ids[st.rid]), st.meta(out)))
                yield SSE_DONE

            return StreamingResponse(events(), media_type="text/event-stream")
        await tm.wait(states, request)
        raise_if_failed(states)
        results = [item(s, s.text, s.output_ids, s.meta()) for s in states]
        return JSONResponse(results if many else results[0])

    # --- OpenAI ----------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return openai.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai.completions(parse(CompletionRequest, await read_json(request, limit)), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai.chat(parse(ChatCompletionRequest, await read_json(request, limit)), request)

    app.state.started = time.time()
    return app
