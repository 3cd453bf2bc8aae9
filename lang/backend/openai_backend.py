"""Any OpenAI-compatible server through the official client: chat models, so `gen` runs inside an assistant
turn (`s += assistant(gen("x"))`), with the finished turns sent as messages.

`select` does what the API allows: a request constrained to the choices (the `regex` extra field, which
radixlm and SGLang servers take), else an unconstrained answer matched against the choices; an answer that
matches none is an error, never a silent guess. Logprob scoring of arbitrary continuations needs prompt
logprobs, which the chat API does not give.
"""
from __future__ import annotations

import re

from radixlm.lang.backend.base import Backend, Call, GenResult, LangError
from radixlm.lang.chat_template import RoleMarkers

_CHAT_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
                "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "seed": "seed"}
_EXTRA_PARAMS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "regex", "min_new_tokens",
                 "stop_token_ids"}


class OpenAI(Backend):
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, **client_kwargs):
        import openai

        self.model = model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", **client_kwargs)
        self._openai = openai

    def role_markers(self) -> RoleMarkers:
        # The server applies the chat template; the program's text only records the turns.
        return RoleMarkers({r: "" for r in ("system", "user", "assistant")},
                           {r: "\n" for r in ("system", "user", "assistant")})

    def _messages(self, call: Call) -> list[dict]:
        if call.role != "assistant":
            raise LangError("the OpenAI backend generates only inside an assistant turn: write "
                            "s += assistant(gen(...)) after the user turn")
        if call.role_text:
            raise LangError("the OpenAI backend cannot continue a partly written assistant turn")
        if not call.messages:
            raise LangError("the OpenAI backend needs at least one finished turn (system or user) before gen")
        return call.messages

    def _create(self, call: Call, params: dict, **extra):
        args, extra_body = {}, {}
        for key, value in params.items():
            if key in _CHAT_PARAMS:
                args[_CHAT_PARAMS[key]] = value
            elif key == "json_schema":
                import json

                schema = json.loads(value) if isinstance(value, str) else value
                args["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
            elif key in _EXTRA_PARAMS:
                extra_body[key] = value
        try:
            return self.client.chat.completions.create(model=self.model, messages=self._messages(call), **args,
                                                       extra_body=extra_body or None, **extra)
        except self._openai.APIStatusError as e:
            raise LangError(f"the OpenAI-compatible server refused the request (HTTP {e.status_code}): "
                            f"{e.message}") from None
        except self._openai.APIConnectionError as e:
            raise LangError(f"no OpenAI-compatible server answered: {e}") from None

    def generate(self, call: Call) -> GenResult:
        r = self._create(call, call.params)
        choice = r.choices[0]
        meta = {"finish_reason": {"type": choice.finish_reason}}
        if r.usage:
            meta.update(prompt_tokens=r.usage.prompt_tokens, completion_tokens=r.usage.completion_tokens)
            details = getattr(r.usage, "prompt_tokens_details", None)
            meta["cached_tokens"] = getattr(details, "cached_tokens", 0) if details else 0
        return GenResult(choice.message.content or "", meta)

    def select(self, call: Call, choices: list[str], method, temperature: float) -> tuple[int, dict]:
        longest = max(len(c) for c in choices)
        regex = "(" + "|".join(re.escape(c) for c in choices) + ")"
        params = {"temperature": temperature, "max_new_tokens": max(8, longest)}
        try:
            text = self.generate(Call(call.text, {**params, "regex": regex}, call.messages, call.role,
                                      call.role_text)).text
            how = "constrained"
        except LangError:  # a server without the regex extension: ask freely, then match
            text = self.generate(Call(call.text, params, call.messages, call.role, call.role_text)).text
            how = "matched"
        for i, c in sorted(enumerate(choices), key=lambda ic: -len(ic[1])):
            if text.strip() == c or text.strip().lower().startswith(c.lower()):
                return i, {"select_method": how, "answer": text}
        raise LangError(f"select over the OpenAI API: the answer {text[:80]!r} matches none of {choices}")
