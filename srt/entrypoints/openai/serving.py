"""/v1/completions, /v1/chat/completions and /v1/models on top of the tokenizer manager."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import jinja2
import orjson
from fastapi.responses import Response, StreamingResponse

from radixlm.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixlm.srt.errors import InvalidRequest, RadixLMError
from radixlm.srt.managers.request_prep import PreparedInput, check_text
from radixlm.srt.managers.tokenizer_manager import ReqState, TokenizerManager
from radixlm.srt.sampling.sampling_params import SamplingParams

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_ROLES = {"system", "user", "assistant", "developer"}
_MAX_TOP_LOGPROBS = 20


class ModelNotFound(RadixLMError):
    status = 404
    code = "model_not_found"


class RequestFailed(RadixLMError):
    """A request the scheduler finished with an error (carries the status it chose)."""

    def __init__(self, reason: dict):
        super().__init__(reason.get("message", "request failed"), param=reason.get("param"))
        self.status = reason.get("status_code", 500)
        self.type = "invalid_request_error" if self.status < 500 else "server_error"


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
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(st.cached_tokens for st in first_sample.values())}}


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, served_model_name: str, model_path: str):
        self.tm = tm
        self.name = served_model_name
        self.model_path = model_path

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": int(time.time()),
                                            "owned_by": "radixlm", "root": self.model_path,
                                            "max_model_len": self.tm.context_length}]}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.name, self.model_path):
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves `{self.name}`.",
                                param="model")

    def _params(self, req, max_tokens: int | None) -> SamplingParams:
        d = {"max_new_tokens": max_tokens, "n": req.n, "stop": req.stop if req.stop is not None else [],
             "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
             "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
             "repetition_penalty": req.repetition_penalty, "min_new_tokens": req.min_tokens,
             "ignore_eos": req.ignore_eos, "stop_token_ids": req.stop_token_ids,
             "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim, "seed": req.seed,
             "logit_bias": req.logit_bias}
        try:
            return SamplingParams.from_dict({k: v for k, v in d.items() if v is not None or k == "max_new_tokens"})
        except InvalidRequest as e:  # speak the OpenAI field names back to the client
            names = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
            param = names.get(e.param, e.param)
            raise InvalidRequest(e.message.replace(e.param or "", param or "", 1), param=param) from None

    def _token_str(self, tid: int) -> str:
        return self.tm.tokenizer.decode([tid])

    # --- /v1/completions -----------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request):
        self._check_model(req.model)
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequest("best_of must equal n (beam-style best_of is not supported)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= _MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {_MAX_TOP_LOGPROBS}]", param="logprobs")
        params = self._params(req, req.max_tokens)
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        inputs = [PreparedInput(*self.tm.tokenize(p), params) for p in prompts]
        want_lp = req.logprobs is not None
        states = self.tm.submit(inputs, return_logprob=want_lp, top_logprobs_num=req.logprobs or 0,
                                logprob_start_len=0 if (want_lp and req.echo) else -1, stream=req.stream,
                                rids=[req.rid] * len(inputs) if req.rid and len(inputs) == 1 and req.n == 1 else None)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._stream_completions(req, states, rid, created, request),
                                     media_type="text/event-stream")
        await self.tm.wait(states, request)
        raise_if_failed(states)
        choices = []
        for st in states:
            text = (self._prompt_text(st) if req.echo else "") + st.text
            choices.append({"index": st.index, "text": text, "finish_reason": _FINISH.get(st.finish_reason["type"]),
                            "logprobs": self._completion_logprobs(st, req.echo) if want_lp else None})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.name,
                               "choices": choices, "usage": usage(states)})

    def _prompt_text(self, st: ReqState) -> str:
        return st.prompt_text if st.prompt_text is not None else self.tm.tokenizer.decode(st.input_ids)

    def _completion_logprobs(self, st: ReqState, echo: bool, start: int = 0, prompt_too: bool | None = None) -> dict:
        entries = []
        if echo if prompt_too is None else prompt_too:
            entries += [(lp, tid, None) for lp, tid in st.input_logprobs]
        tops = st.output_top_logprobs
        entries += [(lp, tid, tops[i] if i < len(tops) else None) for i, (lp, tid) in enumerate(st.output_logprobs)]
        entries = entries[start:]
        tokens, offsets, pos = [], [], 0
        for _, tid, _ in entries:
            tokens.append(self._token_str(tid))
            offsets.append(pos)
            pos += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in entries],
                "top_logprobs": [None if top is None else {self._token_str(t): v for v, t in top}
                                 for _, _, top in entries], "text_offset": offsets}

    async def _stream_completions(self, req: CompletionRequest, states, rid, created, request) -> AsyncIterator[bytes]:
        def chunk(choices, **extra):
            return sse({"id": rid, "object": "text_completion", "created": created, "model": self.name,
                        "choices": choices, **extra})

        want_lp = req.logprobs is not None
        sent_lp = {st.rid: 0 for st in states}
        if req.echo:
            for st in states:
                yield chunk([{"index": st.index, "text": self._prompt_text(st), "logprobs": None,
                              "finish_reason": None}])
        async for st, out in self.tm.updates(states):
            if st.failed:
                yield sse(RequestFailed(st.finish_reason).to_dict())
                continue
            lp = None
            if want_lp and out.new_ids:
                lp = self._completion_logprobs(st, False, start=sent_lp[st.rid], prompt_too=False)
                sent_lp[st.rid] = len(st.output_logprobs)
            finish = _FINISH.get(st.finish_reason["type"]) if out.finished_reason else None
            if out.delta or finish or lp:
                yield chunk([{"index": st.index, "text": out.delta, "logprobs": lp, "finish_reason": finish}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage(states))
        yield SSE_DONE

    # --- /v1/chat/completions ------------------------------------------------------------------------------
    def chat_input_ids(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            if m.role not in _ROLES:
                raise InvalidRequest(f"messages[{i}].role: unsupported role {m.role!r} "
                                     f"(supported: {', '.join(sorted(_ROLES))})", param=f"messages[{i}].role")
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            check_text(content, f"messages[{i}].content")
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            ids = self.tm.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, tokenize=True)
        except (jinja2.TemplateError, ValueError) as e:
            raise InvalidRequest(f"messages cannot be rendered by the chat template: {e}", param="messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def chat(self, req: ChatCompletionRequest, request):
        self._check_model(req.model)
        if req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequest(f"response_format {req.response_format.type!r} is not supported yet",
                                 param="response_format")
        if req.tools:
            raise InvalidRequest("tools are not supported yet", param="tools")
        top = req.top_logprobs
        if top is not None and (not req.logprobs or not 0 <= top <= _MAX_TOP_LOGPROBS):
            raise InvalidRequest(f"top_logprobs must be in [0, {_MAX_TOP_LOGPROBS}] and needs logprobs=true",
                                 param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, max_tokens)
        ids = self.chat_input_ids(req)
        states = self.tm.submit([PreparedInput(ids, None, params)], return_logprob=req.logprobs,
                                top_logprobs_num=top or 0, stream=req.stream,
                                rids=[req.rid] if req.rid and req.n == 1 else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._stream_chat(req, states, rid, created), media_type="text/event-stream")
        await self.tm.wait(states, request)
        raise_if_failed(states)
        choices = [{"index": st.index, "message": {"role": "assistant", "content": st.text},
                    "logprobs": {"content": self._chat_logprobs(st)} if req.logprobs else None,
                    "finish_reason": _FINISH.get(st.finish_reason["type"])} for st in states]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.name,
                               "choices": choices, "usage": usage(states)})

    def _chat_logprobs(self, st: ReqState, start: int = 0) -> list[dict]:
        out = []
        tops = st.output_top_logprobs
        for i in range(start, len(st.output_logprobs)):
            lp, tid = st.output_logprobs[i]
            tok = self._token_str(tid)
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
            if i < len(tops):
                entry["top_logprobs"] = [{"token": (t := self._token_str(x)), "logprob": v,
                                          "bytes": list(t.encode("utf-8"))} for v, x in tops[i]]
            out.append(entry)
        return out

    async def _stream_chat(self, req: ChatCompletionRequest, states, rid, created) -> AsyncIterator[bytes]:
        def chunk(choices, **extra):
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.name,
                        "choices": choices, **extra})

        for st in states:
            yield chunk([{"index": st.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        sent_lp = {st.rid: 0 for st in states}
        async for st, out in self.tm.updates(states):
            if st.failed:
                yield sse(RequestFailed(st.finish_reason).to_dict())
                continue
            lp = None
            if req.logprobs and out.new_ids:
                lp = {"content": self._chat_logprobs(st, sent_lp[st.rid])}
                sent_lp[st.rid] = len(st.output_logprobs)
            if out.delta or lp:
                yield chunk([{"index": st.index, "delta": {"content": out.delta}, "logprobs": lp,
                              "finish_reason": None}])
            if out.finished_reason:
                yield chunk([{"index": st.index, "delta": {}, "logprobs": None,
                              "finish_reason": _FINISH.get(st.finish_reason["type"])}])
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=usage(states))
        yield SSE_DONE
