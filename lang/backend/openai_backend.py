"""Any OpenAI-compatible server through the official client, driving a chat model or a completion model.

A chat model (`is_chat_model=True`, the default unless the name is a known instruct model) takes turns: `gen`
runs inside an assistant turn, the finished turns go as messages, and a partly written assistant turn is
continued (`continue_final_message`, which radixlm, vLLM and SGLang servers take). A completion model takes the
program's text as the prompt, so every program a native backend runs runs here too.

`select` on a completion model scores each choice by its prompt logprobs (`echo` with `logprobs`), as the
native backends do. On a chat model, or a server without prompt logprobs, it asks for an answer constrained to
the choices (the `regex` extra field, which radixlm and SGLang servers take), else an unconstrained answer matched
against the choices; an answer that matches none is an error, never a silent guess.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator

from radixlm.lang import choices as choice_scoring
from radixlm.lang.backend.base import Backend, Call, GenResult, LangError
from radixlm.lang.chat_template import ROLES, RoleMarkers

_PARAMS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "n": "n",
}
_EXTRA_PARAMS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "regex", "stop_token_ids"}
_RENAMED_EXTRAS = {"min_new_tokens": "min_tokens"}
# OpenAI's completion models (SGLang's list, and the other two still served)
INSTRUCT_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


class OpenAI(Backend):
    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        chat_template: RoleMarkers | None = None,
        is_azure: bool = False,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        **client_kwargs,
    ):
        import openai

        if chat_template is not None and not isinstance(chat_template, RoleMarkers):
            raise LangError(
                "OpenAI(chat_template=...) takes a radixlm.lang.chat_template.RoleMarkers (the text "
                "around each role's content, for completion models)"
            )
        self.model_name = self.model = model_name
        self.is_chat_model = model_name not in INSTRUCT_MODEL_NAMES if is_chat_model is None else bool(is_chat_model)
        key = api_key or os.environ.get("AZURE_OPENAI_API_KEY" if is_azure else "OPENAI_API_KEY") or "none"
        if is_azure:
            self.client = openai.AzureOpenAI(api_key=key, **client_kwargs)
        else:
            self.client = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self._openai = openai
        self._chat_template = chat_template
        self.rng = random.Random(0)

    def get_model_name(self) -> str:
        return self.model_name

    def role_markers(self) -> RoleMarkers:
        if self.is_chat_model:  # the server applies the chat template; the program's text only records the turns
            return RoleMarkers({r: "" for r in ROLES}, {r: "\n" for r in ROLES})
        return self._chat_template or RoleMarkers.plain()

    # --- requests ------------------------------------------------------------------------------------------
    def _args(self, call: Call, params: dict) -> dict:
        args, extra = {}, {}
        for key, value in params.items():
            if key in _PARAMS:
                args[_PARAMS[key]] = value
            elif key in _EXTRA_PARAMS:
                extra[key] = value
            elif key in _RENAMED_EXTRAS:
                extra[_RENAMED_EXTRAS[key]] = value
            elif key == "json_schema":
                schema = json.loads(value) if isinstance(value, str) else value
                if self.is_chat_model:
                    args["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": "output", "schema": schema},
                    }
                else:
                    extra["json_schema"] = json.dumps(schema)
            elif key == "logprob_start_len":
                if value not in (None, -1):
                    raise LangError("logprob_start_len (prompt logprobs) is not available through the OpenAI API")
            elif key == "return_logprob":
                if value:
                    top = params.get("top_logprobs_num") or 0
                    if self.is_chat_model:
                        args["logprobs"] = True
                        if top:
                            args["top_logprobs"] = top
                    else:
                        args["logprobs"] = top
            elif key not in ("top_logprobs_num", "return_text_in_logprobs"):
                raise LangError(f"the OpenAI backend cannot send {key!r}")
        if extra:
            args["extra_body"] = extra
        if self.is_chat_model:
            args["messages"], continued = self._messages(call)
            if continued:
                args.setdefault("extra_body", {}).update(continue_final_message=True, add_generation_prompt=False)
        else:
            args["prompt"] = call.text
        return args

    def _messages(self, call: Call) -> tuple[list[dict], bool]:
        if call.role != "assistant":
            raise LangError(
                "the OpenAI backend drives a chat model: gen runs only inside an assistant turn "
                "(s += assistant(gen(...))); pass is_chat_model=False for a completion model"
            )
        if not call.messages:
            raise LangError("the OpenAI backend needs at least one finished turn (system or user) before gen")
        if call.role_text:  # continue the partly written turn
            return [*call.messages, {"role": "assistant", "content": call.role_text}], True
        return list(call.messages), False

    def _create(self, call: Call, params: dict, **more):
        args = {**self._args(call, params), **more}
        api = self.client.chat.completions if self.is_chat_model else self.client.completions
        try:
            return api.create(model=self.model_name, **args)
        except self._openai.APIStatusError as e:
            hint = ""
            if (args.get("extra_body") or {}).get("continue_final_message"):
                hint = (
                    " (continuing a partly written assistant turn needs a server that takes "
                    "continue_final_message, such as radixlm, vLLM or SGLang; or use num_api_spec_tokens)"
                )
            raise LangError(
                f"the OpenAI-compatible server refused the request (HTTP {e.status_code}): {e.message}{hint}"
            ) from None
        except self._openai.APIConnectionError as e:
            raise LangError(f"no OpenAI-compatible server answered: {e}") from None

    def _meta(self, choice, usage) -> dict:
        meta = {"finish_reason": {"type": choice.finish_reason}}
        if usage:
            meta.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
            details = getattr(usage, "prompt_tokens_details", None)
            meta["cached_tokens"] = (getattr(details, "cached_tokens", 0) or 0) if details else 0
        lps = _logprobs(choice.logprobs, self.is_chat_model)
        if lps:
            meta.update(lps)
        return meta

    def _text(self, choice) -> str:
        return (choice.message.content if self.is_chat_model else choice.text) or ""

    def generate(self, call: Call) -> GenResult:
        r = self._create(call, call.params)
        if r.usage:
            self.token_usage.add(r.usage.prompt_tokens, r.usage.completion_tokens)
        results = [GenResult(self._text(c), self._meta(c, r.usage)) for c in sorted(r.choices, key=lambda c: c.index)]
        if len(results) == 1:
            return results[0]
        return GenResult(results[0].text, results[0].meta, samples=results)

    def stream(self, call: Call) -> Iterator[tuple[str, GenResult | None]]:
        stream = self._create(call, call.params, stream=True, stream_options={"include_usage": True})
        text, finish, usage = [], None, None
        try:
            for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    piece = (c.delta.content if self.is_chat_model else c.text) or ""
                    finish = c.finish_reason or finish
                    if piece:
                        text.append(piece)
                        yield piece, None
        finally:
            stream.close()  # also when the reader stops early: the server ends the request
        if usage:
            self.token_usage.add(usage.prompt_tokens, usage.completion_tokens)
        meta = {"finish_reason": {"type": finish}}
        if usage:
            meta.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        yield "", GenResult("".join(text), meta)

    # --- select --------------------------------------------------------------------------------------------
    def select(self, call: Call, choices: list[str], method, temperature: float) -> tuple[int, dict]:
        if not self.is_chat_model:
            scored = self._score(call.text, choices, method)
            if scored is not None:
                cond, uncond = scored
                best, scores = choice_scoring.pick(method, cond, uncond)
                if temperature > 0:
                    best = choice_scoring.sample(scores, temperature, self.rng)
                meta = {
                    "normalized_prompt_logprobs": scores,
                    "input_token_logprobs": cond,
                    "select_method": "prompt_logprobs",
                    "finish_reason": {"type": "stop", "matched": choices[best]},
                }
                if uncond is not None:
                    meta["unconditional_token_logprobs"] = uncond
                return best, meta
        return self._select_by_answer(call, choices, temperature)

    def _score(self, prefix: str, choices: list[str], method) -> tuple[list, list | None] | None:
        """Each choice's token logprobs after `prefix` (and alone, for the unconditional method), from one
        request for prompt logprobs; None when the server does not give them."""
        prompts = [prefix] + [prefix + c for c in choices]
        if method.name == "unconditional_likelihood_normalized":
            prompts += list(choices)
        try:
            r = self.client.completions.create(
                model=self.model_name, prompt=prompts, echo=True, logprobs=0, max_tokens=0, temperature=0
            )
        except (self._openai.APIStatusError, self._openai.APIConnectionError):
            return None
        if r.usage:
            self.token_usage.add(r.usage.prompt_tokens, r.usage.completion_tokens)
        got = sorted(r.choices, key=lambda c: c.index)
        if len(got) != len(prompts) or any(c.logprobs is None or not c.logprobs.tokens for c in got):
            return None
        toks = [list(c.logprobs.tokens) for c in got]
        lps = [list(c.logprobs.token_logprobs) for c in got]
        cond = []
        for i in range(1, len(choices) + 1):
            k = choice_scoring.after_prefix(toks[0], toks[i])
            cond.append([lp for lp in lps[i][k:] if lp is not None])
        uncond = [[lp for lp in x if lp is not None] for x in lps[len(choices) + 1 :]] or None
        return cond, uncond

    def _select_by_answer(self, call: Call, choices: list[str], temperature: float) -> tuple[int, dict]:
        longest = max(len(c) for c in choices)
        regex = "(" + "|".join(re.escape(c) for c in choices) + ")"
        params = {"temperature": temperature, "max_new_tokens": max(8, longest)}
        try:
            text = self.generate(
                Call(call.text, {**params, "regex": regex}, call.messages, call.role, call.role_text)
            ).text
            how = "constrained"
        except LangError:  # a server without the regex extension: ask freely, then match
            text = self.generate(Call(call.text, params, call.messages, call.role, call.role_text)).text
            how = "matched"
        for i, c in sorted(enumerate(choices), key=lambda ic: -len(ic[1])):
            if text.strip() == c or text.strip().lower().startswith(c.lower()):
                return i, {"select_method": how, "answer": text}
        raise LangError(f"select over the OpenAI API: the answer {text[:80]!r} matches none of {choices}")

    def shutdown(self) -> None:
        self.client.close()


def _logprobs(lp, chat: bool) -> dict:
    """OpenAI's logprobs in SGLang's meta-info shape, (logprob, token id, token text); the API gives no ids."""
    if lp is None:
        return {}
    if chat:
        items = lp.content or []
        out = [(x.logprob, None, x.token) for x in items]
        tops = [[(t.logprob, None, t.token) for t in (x.top_logprobs or [])] for x in items]
    else:
        out = [(v, None, t) for t, v in zip(lp.tokens or [], lp.token_logprobs or [])]
        tops = [[(v, None, t) for t, v in (top or {}).items()] for top in (lp.top_logprobs or [])]
    meta = {"output_token_logprobs": out}
    if any(tops):
        meta["output_top_logprobs"] = tops
    return meta
