"""/v1/completions, /v1/chat/completions and /v1/models on top of the tokenizer manager."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator

import jinja2
import orjson
from fastapi.responses import Response, StreamingResponse

from radixlm.srt.constrained.vocab import token_bytes
from radixlm.srt.entrypoints.openai import tools as tooling
from radixlm.srt.entrypoints.openai.constraints import grammar_fields, grammar_param
from radixlm.srt.entrypoints.openai.messages import chat_message
from radixlm.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, UnsupportedField
from radixlm.srt.errors import GrammarError, InvalidRequest, RadixLMError
from radixlm.srt.managers.io_struct import FinishReason
from radixlm.srt.managers.request_prep import PreparedInput
from radixlm.srt.managers.tokenizer_manager import ReqState, TokenizerManager
from radixlm.srt.sampling.sampling_params import SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_MAX_TOP_LOGPROBS = 20


class ModelNotFound(RadixLMError):
    status = 404
    code = "model_not_found"


class RequestFailed(RadixLMError):
    """A request the scheduler finished with an error (carries the status it chose)."""

    def __init__(self, reason: FinishReason):
        super().__init__(reason.message or "request failed", param=reason.param)
        self.status = reason.status_code or 500
        self.type = "invalid_request_error" if self.status < 500 else "server_error"


def _call_incomplete(max_tokens: int | None) -> InvalidRequest:
    """tool_choice required or named: the grammar admits nothing but a call, so an answer without a whole call
    ran out of tokens first; an error, never a plain answer in place of the call."""
    return InvalidRequest(
        f"the answer reached max_tokens ({max_tokens}) before its tool call was complete; raise max_tokens",
        param="max_tokens",
    )


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def raise_if_failed(states: list[ReqState]) -> None:
    for st in states:
        if st.failed:
            raise RequestFailed(st.finish_reason)


def usage(states: list[ReqState]) -> dict:
    first_sample = {}
    for st in states:
        first_sample.setdefault(st.prompt_index, st)
    prompt = sum(st.prompt_tokens or len(st.input_ids) for st in first_sample.values())
    completion = sum(st.completion_tokens for st in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(st.cached_tokens for st in first_sample.values())},
    }


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, served_model_name: str, model_path: str):
        self.tm = tm
        self.name = served_model_name
        self.model_path = model_path
        # `created` names the model, not the request: its files' time (the same on every replica serving them)
        try:
            self.created = int(os.stat(model_path).st_mtime)
        except OSError:
            self.created = int(time.time())

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "radixlm",
                    "root": self.model_path,
                    "max_model_len": self.tm.context_length,
                }
            ],
        }

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.name, self.model_path):
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves `{self.name}`.", param="model")

    def _params(self, req, max_tokens: int | None, **grammar) -> SamplingParams:
        d = {
            **grammar,
            "max_new_tokens": max_tokens,
            "n": req.n,
            "stop": req.stop if req.stop is not None else [],
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "min_p": req.min_p,
            "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty,
            "min_new_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos,
            "stop_token_ids": req.stop_token_ids,
            "skip_special_tokens": req.skip_special_tokens,
            "no_stop_trim": req.no_stop_trim,
            "seed": req.seed,
            "logit_bias": req.logit_bias,
        }
        try:
            return SamplingParams.from_dict({k: v for k, v in d.items() if v is not None or k == "max_new_tokens"})
        except GrammarError:
            raise  # the caller names the field the grammar came in
        except InvalidRequest as e:  # speak the OpenAI field names back to the client
            names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "tool_call": "tools"}
            param = names.get(e.param, e.param)
            raise InvalidRequest(e.message.replace(e.param or "", param or "", 1), param=param) from None

    async def _sampling(self, req, max_tokens: int | None, grammar: dict) -> SamplingParams:
        """The request's sampling parameters. A grammar is checked on the tokenizer thread (the meta-schema and
        backend checks of a large schema take tenths of a second the first time; the results are cached, so the
        checks `submit` repeats find them done)."""
        if not grammar:
            return self._params(req, max_tokens)

        def build() -> SamplingParams:
            params = self._params(req, max_tokens, **grammar)
            self.tm.check_grammar(params)
            return params

        return await self.tm.off_loop(build)

    def _token_str(self, tid: int) -> str:
        return self.tm.tokenizer.decode([tid])

    def _token_bytes(self, tid: int, text: str) -> list[int]:
        """The token's own bytes (OpenAI's `bytes`): a token holding part of a UTF-8 character decodes to U+FFFD
        on its own, and only its raw bytes, joined with its neighbours', give the character back."""
        raw = token_bytes(self.tm.tokenizer).by_id.get(tid)
        return list(raw if raw is not None else text.encode("utf-8"))

    # --- /v1/completions -----------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request):
        self._check_model(req.model)
        if req.suffix:
            raise UnsupportedField(
                "suffix is not supported: insertion (text after the answer) is not implemented", param="suffix"
            )
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequest("best_of must equal n (beam-style best_of is not supported)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= _MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {_MAX_TOP_LOGPROBS}]", param="logprobs")
        grammar, field = grammar_fields(req)
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        want_lp = req.logprobs is not None
        try:
            params = await self._sampling(req, req.max_tokens, grammar)
            inputs = [PreparedInput(*tok, params) for tok in await self.tm.tokenize_many(prompts)]
            states = self.tm.submit(
                inputs,
                return_logprob=want_lp,
                top_logprobs_num=req.logprobs or 0,
                logprob_start_len=0 if (want_lp and req.echo) else -1,
                stream=req.stream,
                rids=[req.rid] * len(inputs) if req.rid and len(inputs) == 1 and req.n == 1 else None,
            )
        except GrammarError as e:
            raise grammar_param(field, e) from None
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                self._stream_completions(req, states, rid, created, request), media_type="text/event-stream"
            )
        await self.tm.wait(states, request)
        try:
            raise_if_failed(states)
        except RequestFailed as e:
            raise grammar_param(field, e) from None
        choices = []
        for st in states:
            text = (self._prompt_text(st) if req.echo else "") + st.text
            choices.append(
                {
                    "index": st.index,
                    "text": text,
                    "finish_reason": _FINISH.get(st.finish_reason.type),
                    "logprobs": self._completion_logprobs(
                        st.output_logprobs, st.output_top_logprobs, st.input_logprobs if req.echo else ()
                    )
                    if want_lp
                    else None,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.name,
                "choices": choices,
                "usage": usage(states),
            }
        )

    def _prompt_text(self, st: ReqState) -> str:
        return st.prompt_text if st.prompt_text is not None else self.tm.tokenizer.decode(st.input_ids)

    def _completion_logprobs(self, output_lps: list, output_tops: list | None, prompt_lps: list = ()) -> dict:
        """OpenAI's completion `logprobs` for these tokens: the prompt's entries (echo), then the outputs'."""
        tops = output_tops or []
        entries = [(lp, tid, None) for lp, tid in prompt_lps]
        entries += [(lp, tid, tops[i] if i < len(tops) else None) for i, (lp, tid) in enumerate(output_lps)]
        tokens, offsets, pos = [], [], 0
        for _, tid, _ in entries:
            tokens.append(self._token_str(tid))
            offsets.append(pos)
            pos += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _, _ in entries],
            "top_logprobs": [None if top is None else {self._token_str(t): v for v, t in top} for _, _, top in entries],
            "text_offset": offsets,
        }

    async def _stream_completions(self, req: CompletionRequest, states, rid, created, request) -> AsyncIterator[bytes]:
        def chunk(choices, **extra):
            return sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.name,
                    "choices": choices,
                    **extra,
                }
            )

        want_lp = req.logprobs is not None
        if req.echo:
            for st in states:
                yield chunk(
                    [{"index": st.index, "text": self._prompt_text(st), "logprobs": None, "finish_reason": None}]
                )
        async for st, out in self.tm.updates(states):
            if out.failed:
                yield sse(RequestFailed(out.finished_reason).to_dict())
                continue
            # Everything sent comes from this update, not from the state: a handler that lags behind may find
            # the state already further on (or finished) while updates before the last are still queued.
            lp = None
            if want_lp and out.output_logprobs:
                lp = self._completion_logprobs(out.output_logprobs, out.output_top_logprobs)
            finish = _FINISH.get(out.finished_reason.type) if out.finished_reason else None
            if out.delta or finish or lp:
                yield chunk([{"index": st.index, "text": out.delta, "logprobs": lp, "finish_reason": finish}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage(states))
        yield SSE_DONE

    # --- /v1/chat/completions ------------------------------------------------------------------------------
    def chat_input_ids(self, req: ChatCompletionRequest, funcs: list[dict] | None = None) -> list[int]:
        if not req.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        funcs = funcs or []
        own = bool(funcs) and tooling.template_takes_tools(self.tm.tokenizer)
        messages = [chat_message(i, m, own) for i, m in enumerate(req.messages)]
        messages = tooling.render_messages(messages, funcs, own)
        kw = {"tools": [{"type": "function", "function": f} for f in funcs]} if own else {}
        try:
            ids = self.tm.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                tokenize=True,
                **kw,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise InvalidRequest(f"messages cannot be rendered by the chat template: {e}", param="messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def chat(self, req: ChatCompletionRequest, request):
        self._check_model(req.model)
        funcs, mode, name = tooling.check_tools(req.tools, req.tool_choice)
        top = req.top_logprobs
        if top is not None and (not req.logprobs or not 0 <= top <= _MAX_TOP_LOGPROBS):
            raise InvalidRequest(
                f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}] and needs logprobs=true", param="top_logprobs"
            )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        grammar, field = grammar_fields(req, mode, funcs, name)
        try:
            params = await self._sampling(req, max_tokens, grammar)
            # Rendering and tokenizing the messages runs on the tokenizer thread, off the event loop.
            ids = await self.tm.off_loop(lambda: self.chat_input_ids(req, funcs if mode != "none" else []))
            states = self.tm.submit(
                [PreparedInput(ids, None, params)],
                return_logprob=req.logprobs,
                top_logprobs_num=top or 0,
                stream=req.stream,
                rids=[req.rid] if req.rid and req.n == 1 else None,
            )
        except GrammarError as e:
            raise grammar_param(field, e) from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        calls_on = mode != "none"
        if req.stream:
            return StreamingResponse(
                self._stream_chat(
                    req, states, rid, created, funcs if calls_on else None, forced=mode in ("required", "named")
                ),
                media_type="text/event-stream",
            )
        await self.tm.wait(states, request)
        try:
            raise_if_failed(states)
        except RequestFailed as e:
            raise grammar_param(field, e) from None
        choices = []
        for st in states:
            message, finish = {"role": "assistant", "content": st.text}, _FINISH.get(st.finish_reason.type)
            if calls_on:
                content, calls = tooling.parse_tool_calls(st.text, funcs)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = "tool_calls"
                elif mode in ("required", "named"):
                    raise _call_incomplete(max_tokens)
            choices.append(
                {
                    "index": st.index,
                    "message": message,
                    "logprobs": {"content": self._chat_logprobs(st.output_logprobs, st.output_top_logprobs)}
                    if req.logprobs
                    else None,
                    "finish_reason": finish,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": self.name,
                "choices": choices,
                "usage": usage(states),
            }
        )

    def _chat_logprobs(self, output_lps: list, output_tops: list | None) -> list[dict]:
        out = []
        tops = output_tops or []
        for i, (lp, tid) in enumerate(output_lps):
            tok = self._token_str(tid)
            entry = {"token": tok, "logprob": lp, "bytes": self._token_bytes(tid, tok), "top_logprobs": []}
            if i < len(tops):
                entry["top_logprobs"] = [
                    {"token": (t := self._token_str(x)), "logprob": v, "bytes": self._token_bytes(x, t)}
                    for v, x in tops[i]
                ]
            out.append(entry)
        return out

    async def _stream_chat(
        self, req: ChatCompletionRequest, states, rid, created, funcs: list[dict] | None, forced: bool = False
    ) -> AsyncIterator[bytes]:
        """With tools, text that may still become a tool call is held back; a call is sent whole, as one
        delta.tool_calls entry, when its answer finishes."""

        def chunk(choices, **extra):
            return sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.name,
                    "choices": choices,
                    **extra,
                }
            )

        for st in states:
            yield chunk(
                [
                    {
                        "index": st.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        held = {st.rid: "" for st in states}  # text not yet sent while it may be a tool call
        tag = tooling.BEGIN.strip()
        async for st, out in self.tm.updates(states):
            if out.failed:
                yield sse(RequestFailed(out.finished_reason).to_dict())
                continue
            # From this update only (see _stream_completions): the state may be further on already.
            lp = None
            if req.logprobs and out.output_logprobs:
                lp = {"content": self._chat_logprobs(out.output_logprobs, out.output_top_logprobs)}
            delta = out.delta
            if funcs is not None and held[st.rid] is not None:
                text = held[st.rid] + delta
                start = text.lstrip()
                if tag.startswith(start) or start.startswith(tag):
                    held[st.rid], delta = text, ""  # may still be (or is) a call
                else:
                    held[st.rid], delta = None, text  # plain text: stream from here on
            if delta or lp:
                yield chunk([{"index": st.index, "delta": {"content": delta}, "logprobs": lp, "finish_reason": None}])
            if out.finished_reason:
                finish = _FINISH.get(out.finished_reason.type)
                content, calls = tooling.parse_tool_calls(held[st.rid], funcs) if funcs and held[st.rid] else (None, [])
                if forced and not calls:  # the grammar forced a call, but the answer ended before it was whole
                    yield sse(_call_incomplete(req.max_completion_tokens or req.max_tokens).to_dict())
                    continue
                if calls:
                    yield chunk(
                        [
                            {
                                "index": st.index,
                                "delta": {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                    finish = "tool_calls"
                if content:
                    yield chunk(
                        [{"index": st.index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]
                    )
                yield chunk([{"index": st.index, "delta": {}, "logprobs": None, "finish_reason": finish}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage(states))
        yield SSE_DONE
