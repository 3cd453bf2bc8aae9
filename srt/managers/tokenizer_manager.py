"""The tokenizer manager: lives in the HTTP process. Validates and tokenizes requests, sends them to the
scheduler, and keeps one state (and an update queue per submission) for every request in flight."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from radixlm.srt.constrained.spec import check_supported
from radixlm.srt.cpu_guard import CpuGuard, guard_wanted
from radixlm.srt.errors import InvalidRequest, Overloaded, RadixLMError
from radixlm.srt.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    ControlReq,
    ControlResp,
    FinishReason,
    GenerateReq,
    TokenizerIn,
    TokenOutput,
    spec_meta,
)
from radixlm.srt.managers.request_prep import PreparedInput, check_request_limits, expand, tokenize
from radixlm.srt.metrics import Metrics

logger = logging.getLogger(__name__)

_DISCONNECT_CHECK_S = 0.5  # how often a waiting non-streaming handler checks that its client is still there


class ServiceUnavailable(RadixLMError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


async def _next_update(queue: asyncio.Queue):
    """The queue's next item, or asyncio.TimeoutError after _DISCONNECT_CHECK_S. Not a wait_for task per item
    where it can be helped: at thousands of streamed tokens per second those tasks add up."""
    if not queue.empty():
        return queue.get_nowait()
    if hasattr(asyncio, "timeout"):  # Python 3.11+
        async with asyncio.timeout(_DISCONNECT_CHECK_S):
            return await queue.get()
    return await asyncio.wait_for(queue.get(), timeout=_DISCONNECT_CHECK_S)


@dataclass(eq=False)
class ReqState:
    rid: str
    index: int  # position within its submission: prompt-major, then sample
    prompt_index: int
    input_ids: list[int]
    prompt_text: str | None
    queue: asyncio.Queue  # shared by every request of one submission
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    spec: tuple[int, int, int] | None = None  # speculative decoding counters (TokenOutput.spec)
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        """Finished by an error (it carries the HTTP status to answer with), not by a stop, a length or a
        client's abort."""
        return self.finish_reason is not None and self.finish_reason.failed

    def meta(self, upto: TokenOutput | None = None) -> dict:
        """The native API's meta_info: of the request now, or as of its update `upto` (a streamed chunk), whose
        token counts and finish reason it reports and whose number of tokens bounds the logprobs listed."""
        src = self if upto is None else upto
        n = src.completion_tokens
        reason = self.finish_reason if upto is None else upto.finished_reason
        m = {
            "id": self.rid,
            "finish_reason": None if reason is None else reason.to_dict(),
            "prompt_tokens": src.prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": src.cached_tokens,
            "e2e_latency": (self.last_token_at or time.perf_counter()) - self.created,
        }
        if self.output_logprobs:
            m["output_token_logprobs"] = self.output_logprobs[:n]
        if self.output_top_logprobs:
            m["output_top_logprobs"] = self.output_top_logprobs[:n]
        if self.input_logprobs:
            m["input_token_logprobs"] = self.input_logprobs
        spec = self.spec if upto is None else upto.spec
        if spec is not None:
            m.update(spec_meta(spec))
        return m

    def final_output(self) -> TokenOutput:
        """An update with no new tokens that only says this request has finished (aborted or failed here)."""
        return TokenOutput(
            self.rid,
            [],
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            finished_reason=self.finish_reason,
        )


class TokenizerManager:
    def __init__(self, args, tokenizer, info: dict, endpoints: dict, metrics: Metrics):
        self.args = args
        self.tokenizer = tokenizer
        self.info = info
        self.endpoints = endpoints
        self.metrics = metrics
        self.context_length = info["context_length"]
        self.kv_size = info["max_total_tokens"]
        self.vocab_size = info["vocab_size"]
        self.eos_ids = info["eos_token_ids"]
        self.states: dict[str, ReqState] = {}
        self.dead: str | None = None  # why the server can no longer serve, once a child died
        self._rng = random.Random(args.random_seed)
        self._control_ids = itertools.count()
        self._control_waiters: dict[int, asyncio.Future] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self.cpu_guard: CpuGuard | None = None
        # Long prompts are tokenized off the event loop (the Rust tokenizer lets go of the GIL): a 512-token
        # prompt can take tens of ms, and every other stream's next chunk would wait behind it. Short
        # prompts and token strings stay on the loop thread, so two calls can use the tokenizer at once; that
        # is safe because they only read it (every call passes the same settings, so transformers never
        # reconfigures the Rust tokenizer mid-call). One worker keeps the long ones in order.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def start(self) -> None:
        ctx = zmq.asyncio.Context()
        self.to_scheduler = ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(self.endpoints["scheduler"])
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(self.endpoints["tokenizer"])
        self._recv_task = asyncio.create_task(self._recv_loop())
        if guard_wanted(self.args.scheduler_cpus, self.info.get("device", "cpu")):
            # every token reaches its client through this loop: keep it off CPUs interrupts take time from
            self.cpu_guard = CpuGuard("http server")
            self._guard_task = asyncio.create_task(self.cpu_guard.run_in_loop())

    # --- submission ------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        return tokenize(self.tokenizer, prompt)

    INLINE_TOKENIZE_CHARS = 256  # shorter text costs less to tokenize than a hop to the thread and back

    async def tokenize_many(self, prompts: list) -> list[tuple[list[int], str | None]]:
        """`tokenize` for each prompt, on the tokenizer thread when there is long text among them."""
        if all(not isinstance(p, str) or len(p) <= self.INLINE_TOKENIZE_CHARS for p in prompts):
            return [self.tokenize(p) for p in prompts]
        return await self.off_loop(lambda: [self.tokenize(p) for p in prompts])

    async def off_loop(self, fn):
        """Run `fn()` (tokenizer work) on the tokenizer thread; its exceptions reach the caller."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn)

    def check_grammar(self, params) -> None:
        """The edge's check of a request's grammar (a GrammarError naming what no backend here enforces)."""
        spec = params.grammar()
        if spec is not None:
            check_supported(spec, self.args.grammar_backend)

    def submit(
        self,
        inputs: list[PreparedInput],
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        rids: list[str | None] | None = None,
    ) -> list[ReqState]:
        """Validate everything first (all or nothing), then send one request per prompt and sample."""
        if self.dead:
            raise ServiceUnavailable(f"the server cannot serve requests: {self.dead}")
        rids = rids or [None] * len(inputs)
        reqs = []
        for i, (prepared, rid) in enumerate(zip(inputs, rids)):
            if rid is not None and (not isinstance(rid, str) or not rid):
                raise InvalidRequest("rid must be a non-empty string", param="rid")
            check_request_limits(
                prepared.input_ids, prepared.params, self.context_length, self.kv_size, self.vocab_size
            )
            for r in expand(
                prepared,
                rid=rid,
                eos_ids=self.eos_ids,
                rng=self._rng,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                stream=stream,
                grammar_backend=self.args.grammar_backend,
            ):
                reqs.append((i, prepared, r))
        clash = [r.rid for _, _, r in reqs if r.rid in self.states]
        if clash or len({r.rid for _, _, r in reqs}) != len(reqs):
            raise InvalidRequest(f"request id {(clash or [reqs[0][2].rid])[0]!r} is already in use", param="rid")
        limit = self.args.max_queued_requests
        if limit is not None and len(self.states) + len(reqs) > limit:
            raise Overloaded(f"the server has {len(self.states)} requests in flight (limit {limit}); retry later")
        queue: asyncio.Queue = asyncio.Queue()
        states = []
        for index, (i, prepared, r) in enumerate(reqs):
            st = ReqState(
                rid=r.rid, index=index, prompt_index=i, input_ids=r.input_ids, prompt_text=prepared.text, queue=queue
            )
            self.states[r.rid] = st
            states.append(st)
            self.to_scheduler.send(
                self._encoder.encode(
                    GenerateReq(
                        rid=r.rid,
                        input_ids=r.input_ids,
                        sampling_params=r.sampling_params.to_dict(),
                        seed=r.seed,
                        return_logprob=r.return_logprob,
                        top_logprobs_num=r.top_logprobs_num,
                        logprob_start_len=r.logprob_start_len,
                        stream=stream,
                    )
                )
            )
        self.metrics.requests_in_flight.set(len(self.states))
        return states

    async def updates(self, states: list[ReqState], request=None) -> AsyncIterator[tuple[ReqState, TokenOutput]]:
        """Every update of these requests in arrival order, until each one's final update (the one carrying its
        finish reason) has been yielded. If the consumer stops early (a client disconnect cancels it) or the client
        goes away, the unfinished ones are aborted.

        The end is read from the updates, never from the states: a state is finished as soon as its final update
        is *queued*, and a consumer that lags behind (a busy event loop, a stream with much to write) still has
        that update and others before it to take. Every finish queues exactly one final update (`_handle_batch`,
        `abort`, `fail_all`), so each request's end is seen once."""
        if not states:
            return
        queue = states[0].queue
        pending = {s.rid for s in states}
        # A client that hangs up is noticed within _DISCONNECT_CHECK_S: when no update comes for that long, and
        # as often while updates keep coming (a whole answer being generated for no one)
        next_check = time.perf_counter() + _DISCONNECT_CHECK_S
        try:
            while pending:
                try:
                    st, out = await _next_update(queue)
                except asyncio.TimeoutError:
                    st = out = None
                if request is not None and (out is None or time.perf_counter() >= next_check):
                    next_check = time.perf_counter() + _DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        logger.info("client disconnected; aborting %d request(s)", len(pending))
                        return
                if out is None:
                    continue
                if out.finished_reason is not None:
                    pending.discard(st.rid)
                yield st, out
        finally:
            for rid in pending:
                self.abort(rid)

    async def wait(self, states: list[ReqState], request=None) -> None:
        async for _ in self.updates(states, request):
            pass
        unfinished = [s for s in states if not s.finished]
        if unfinished:
            raise asyncio.CancelledError("client disconnected")

    def abort(self, rid: str) -> None:
        """Stop a request in the scheduler and finish it here at once (anyone waiting on it gets the end)."""
        st = self.states.pop(rid, None)
        if st is None:
            return
        self.to_scheduler.send(self._encoder.encode(AbortReq(rid)))
        st.finish_reason = FinishReason.abort()
        st.last_token_at = st.last_token_at or time.perf_counter()
        self.metrics.on_finish(st, st.last_token_at)
        self.metrics.requests_in_flight.set(len(self.states))
        st.queue.put_nowait((st, st.final_output()))

    # --- control ---------------------------------------------------------------------------------------
    async def control(self, kind: str, timeout: float = 10.0, args: dict | None = None):
        if self.dead:
            raise ServiceUnavailable(f"the server cannot serve requests: {self.dead}")
        cid = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters[cid] = fut
        self.to_scheduler.send(self._encoder.encode(ControlReq(cid, kind, args)))
        try:
            resp: ControlResp = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"the scheduler did not answer {kind!r} within {timeout:.0f} s") from None
        finally:
            self._control_waiters.pop(cid, None)
        return resp

    def fail_all(self, reason: str) -> None:
        """A child died: finish every request in flight with an error instead of leaving it hanging."""
        self.dead = reason
        for st in list(self.states.values()):
            st.finish_reason = FinishReason.abort(reason, status_code=503)
            st.queue.put_nowait((st, st.final_output()))
        self.states.clear()
        for fut in self._control_waiters.values():
            if not fut.done():
                fut.set_exception(ServiceUnavailable(reason))

    # --- receiving ---------------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(TokenizerIn)
        while True:
            msg = decoder.decode(await self.recv.recv())
            if isinstance(msg, ControlResp):
                fut = self._control_waiters.get(msg.id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                continue
            self._handle_batch(msg)

    def _handle_batch(self, batch: BatchStrOutput) -> None:
        now = time.perf_counter()
        for out in batch.outputs:
            st = self.states.get(out.rid)
            if st is None:  # aborted by us already
                continue
            st.text += out.delta
            st.output_ids += out.new_ids
            st.prompt_tokens, st.completion_tokens, st.cached_tokens = (
                out.prompt_tokens,
                out.completion_tokens,
                out.cached_tokens,
            )
            if out.spec is not None:
                st.spec = tuple(out.spec)
            if out.input_logprobs:
                st.input_logprobs = list(out.input_logprobs)
            if out.output_logprobs:
                st.output_logprobs += out.output_logprobs
            if out.output_top_logprobs:
                st.output_top_logprobs += out.output_top_logprobs
            if out.new_ids:
                if st.first_token_at is None:
                    st.first_token_at = now
                    self.metrics.ttft.observe(now - st.created)
                elif st.last_token_at is not None:
                    self.metrics.itl.observe((now - st.last_token_at) / len(out.new_ids))
                st.last_token_at = now
                self.metrics.generation_tokens.inc(len(out.new_ids))
            if out.finished_reason is not None:
                st.finish_reason = out.finished_reason
                st.last_token_at = st.last_token_at or now
                del self.states[out.rid]
                self.metrics.on_finish(st, now)
                self.metrics.requests_in_flight.set(len(self.states))
            st.queue.put_nowait((st, out))
