"""Backends that speak our native generate API: `RuntimeEndpoint` (HTTP to a running server), `Runtime` (a
server this process launches and owns) and `EngineBackend` (the in-process Engine, no HTTP).

`select` scores every choice in one batched request that shares the prompt: the prompt alone first (its
token count, and it lands in the radix cache), then prompt + each choice with prompt logprobs from the end
of the prompt on, so the server computes only the choices' tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from radixlm.lang import choices as choice_scoring
from radixlm.lang.backend.base import Backend, Call, GenResult, LangError
from radixlm.lang.chat_template import RoleMarkers, role_markers


def _check_finished(item: dict) -> dict:
    reason = (item.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") == "abort" and reason.get("message"):
        raise LangError(f"the server refused the request: {reason['message']}")
    return item


def _result(item: dict) -> GenResult:
    meta = dict(item.get("meta_info") or {})
    return GenResult(item.get("text", ""), meta)


_LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")
_TOP_LOGPROB_LISTS = ("input_top_logprobs", "output_top_logprobs")


def with_token_texts(item: dict, decode) -> dict:
    """SGLang's `return_text_in_logprobs`: every (logprob, token id) in the meta info gains the token's text.
    (The server does the same for /generate; this is for the in-process Engine.)"""
    meta = item.get("meta_info") or {}

    def entry(e):
        return (*e[:2], decode(e[1])) if isinstance(e, (list, tuple)) and len(e) == 2 else e

    for key in _LOGPROB_LISTS:
        if meta.get(key):
            meta[key] = [entry(e) for e in meta[key]]
    for key in _TOP_LOGPROB_LISTS:
        if meta.get(key):
            meta[key] = [None if top is None else [entry(e) for e in top] for top in meta[key]]
    return item


class NativeBackend(Backend):
    """The shared logic; subclasses move a native request (dict with text, sampling_params, ...)."""

    def __init__(self) -> None:
        self._markers: RoleMarkers | None = None
        self.rng = random.Random(0)

    # --- transport (subclasses) ----------------------------------------------------------------------------
    def _request(self, payload: dict) -> list[dict]:
        raise NotImplementedError

    def _request_stream(self, payload: dict) -> Iterator[dict]:
        raise NotImplementedError

    def _chat_template(self) -> tuple[str | None, dict]:
        raise NotImplementedError

    # --- Backend -------------------------------------------------------------------------------------------
    def role_markers(self) -> RoleMarkers:
        if self._markers is None:
            template, special = self._chat_template()
            self._markers = role_markers(template, **special)
        return self._markers

    def _count(self, items: list[dict]) -> None:
        for item in items:
            meta = item.get("meta_info") or {}
            self.token_usage.add(meta.get("prompt_tokens"), meta.get("completion_tokens"))

    @staticmethod
    def _payload(call: Call) -> dict:
        sampling, options = call.split()
        return {"text": call.text, "sampling_params": sampling, **options}

    def generate(self, call: Call) -> GenResult:
        items = [_check_finished(item) for item in self._request(self._payload(call))]
        self._count(items)
        results = [_result(item) for item in items]
        if len(results) == 1:
            return results[0]
        return GenResult(results[0].text, results[0].meta, samples=results)  # n > 1: one item per sample

    def stream(self, call: Call) -> Iterator[tuple[str, GenResult | None]]:
        sent = ""
        last = None
        for item in self._request_stream({**self._payload(call), "stream": True}):
            _check_finished(item)
            text = item.get("text", "")
            if len(text) > len(sent):
                yield text[len(sent) :], None
                sent = text
            last = item
        if last is None:
            raise LangError("the stream ended without a result")
        self._count([last])
        yield "", _result(last)

    def cache_prefix(self, prefix: str) -> None:
        """SGLang's name for it: prefill `prefix` so later requests find it cached."""
        self.commit_prefix(prefix)

    def commit_prefix(self, text: str) -> int:
        """Prefill `text` (it stays in the radix cache); returns its token count."""
        item = _check_finished(self._request({"text": text, "sampling_params": {"max_new_tokens": 0}})[0])
        self._count([item])
        return int(item["meta_info"]["prompt_tokens"])

    def _token_logprobs(self, texts: list[str], start: int) -> list[list[tuple[float | None, int]]]:
        items = [
            _check_finished(item)
            for item in self._request(
                {
                    "text": texts,
                    "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                    "return_logprob": True,
                    "logprob_start_len": start,
                }
            )
        ]
        self._count(items)
        return [[tuple(e[:2]) for e in item["meta_info"].get("input_token_logprobs") or []] for item in items]

    def _choice_logprobs(self, texts: list[str], start: int) -> list[list[float]]:
        return [[lp for lp, _tok in lps if lp is not None] for lps in self._token_logprobs(texts, start)]

    def _conditional_logprobs(self, prefix: str, n_prefix: int, choices: list[str]) -> list[list[float]]:
        """Per choice, the logprobs of its tokens after `prefix`. The tokenizer may merge the prefix's last
        tokens with a choice's first (a trailing space joins the word: " lookup"), so the tail of the prefix is
        scored too and each choice keeps the tokens from the first one that differs from the prefix alone."""
        start = max(n_prefix - _BOUNDARY_TOKENS, 0)
        alone, *withs = self._token_logprobs([prefix] + [prefix + c for c in choices], start)
        tail = [tok for _lp, tok in alone]
        out = []
        for lps in withs:
            k = choice_scoring.after_prefix(tail, [tok for _lp, tok in lps])
            out.append([lp for lp, _tok in lps[k:] if lp is not None])
        return out

    def select(self, call: Call, choices: list[str], method, temperature: float) -> tuple[int, dict]:
        n_prefix = self.commit_prefix(call.text)
        cond = self._conditional_logprobs(call.text, n_prefix, choices)
        uncond = None
        if method.name == "unconditional_likelihood_normalized":
            uncond = self._choice_logprobs(list(choices), 0)
        best, scores = choice_scoring.pick(method, cond, uncond)
        if temperature > 0:  # sample in proportion to exp(score / T) instead of taking the best
            best = choice_scoring.sample(scores, temperature, self.rng)
        meta = {
            "normalized_prompt_logprobs": scores,
            "input_token_logprobs": cond,
            "prompt_tokens": n_prefix,
            "finish_reason": {"type": "stop", "matched": choices[best]},
        }
        if uncond is not None:
            meta["unconditional_token_logprobs"] = uncond
        return best, meta


_BOUNDARY_TOKENS = 4  # prefix tokens re-scored with each choice (see _conditional_logprobs)


class RuntimeEndpoint(NativeBackend):
    """A running radixlm (or SGLang) server, through its native `/generate`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify=None,
        chat_template_name: str | None = None,
        *,
        timeout: float = 600,
    ):
        super().__init__()
        from radixlm.lang.backend.http_clients import ClientPool  # httpx is imported on first use

        if chat_template_name is not None:
            raise LangError(
                f"chat_template_name={chat_template_name!r}: radixlm renders role blocks with the "
                "server's own chat template (its tokenizer's); named templates are not supported"
            )
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Each request borrows a client no other thread uses meanwhile (see http_clients for why not one shared).
        self._clients = ClientPool(self.base_url, headers, timeout, True if verify is None else verify)
        self.model_info = self._get("/get_model_info")

    def _get(self, path: str) -> dict:
        import httpx

        try:
            with self._clients.lend() as client:
                r = client.get(path)
        except httpx.HTTPError as e:
            raise LangError(f"no server answered at {self.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise LangError(f"{self.base_url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def _chat_template(self):
        return self.model_info.get("chat_template"), {}

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def flush_cache(self) -> bool:
        """Empty the server's radix cache; False (not an error) while requests are running there."""
        import httpx

        try:
            with self._clients.lend() as client:
                r = client.post("/flush_cache")
        except httpx.HTTPError as e:
            raise LangError(f"no server answered at {self.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code == 400:
            return False
        if r.status_code != 200:
            raise self._error(r)
        return True

    @staticmethod
    def _error(r) -> LangError:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:300]
        return LangError(f"the server refused the request (HTTP {r.status_code}): {msg}")

    def _request(self, payload: dict) -> list[dict]:
        import httpx

        try:
            with self._clients.lend() as client:
                r = client.post("/generate", json=payload)
        except httpx.HTTPError as e:
            raise LangError(f"no server answered at {self.base_url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise self._error(r)
        out = r.json()
        return out if isinstance(out, list) else [out]

    def _request_stream(self, payload: dict) -> Iterator[dict]:
        import httpx

        try:
            with self._clients.lend() as client, client.stream("POST", "/generate", json=payload) as r:
                if r.status_code != 200:
                    r.read()
                    raise self._error(r)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    item = json.loads(line[6:])
                    if "error" in item:
                        raise LangError(f"the server failed the request: {item['error'].get('message')}")
                    yield item
        except httpx.HTTPError as e:
            raise LangError(f"no server answered at {self.base_url}: {type(e).__name__}: {e}") from None

    def shutdown(self) -> None:
        self._clients.close()


class EngineBackend(NativeBackend):
    """The in-process Engine. One driver thread owns it, so program threads (forks, run_batch) submit
    requests concurrently and they run batched together."""

    def __init__(self, engine=None, **engine_kwargs):
        super().__init__()
        if engine is None:
            import radixlm

            engine = radixlm.Engine(**engine_kwargs)
            self._owned = True
        else:
            self._owned = False
        self.engine = engine
        from radixlm.lang.backend.engine_driver import EngineDriver

        self.driver = EngineDriver(engine)

    def _chat_template(self):
        tok = self.engine.tokenizer
        return getattr(tok, "chat_template", None), {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

    def get_model_name(self) -> str:
        return self.engine.loaded.model_path

    def get_server_info(self) -> dict:
        """What an in-process engine has of a server's info: its arguments and the scheduler's stats."""
        from dataclasses import asdict

        return {"server_args": asdict(self.engine.server_args), "scheduler": self.driver.call(self.engine.get_stats)}

    def flush_cache(self) -> bool:
        return bool(self.driver.call(self.engine.flush_cache))

    def _decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _request(self, payload: dict) -> list[dict]:
        texts = payload.pop("return_text_in_logprobs", False)  # the Engine has no such option: added here
        items = self.driver.run(payload)
        return [with_token_texts(item, self._decode) for item in items] if texts else items

    def _request_stream(self, payload: dict) -> Iterator[dict]:
        texts = payload.pop("return_text_in_logprobs", False)
        for item in self.driver.stream(payload):
            yield with_token_texts(item, self._decode) if texts else item

    def shutdown(self) -> None:
        self.driver.stop()
        if self._owned:
            self.engine.shutdown()


class Runtime(RuntimeEndpoint):
    """Launches `radixlm serve` in a subprocess and talks to it; `with Runtime(...) as rt:` stops it after.
    Keywords are server flags (`model_path=...`, `max_total_tokens=...`)."""

    def __init__(
        self,
        model_path: str | None = None,
        port: int | None = None,
        timeout: float = 300,
        api_key: str | None = None,
        *,
        launch_timeout: float | None = None,
        **server_args,
    ):
        from radixlm.lang.backend.launch import launch_server

        timeout = launch_timeout if launch_timeout is not None else timeout  # SGLang's name for it
        self.process, url = launch_server(model_path, port, timeout, api_key, server_args)
        try:
            super().__init__(url, api_key=api_key)
        except BaseException:
            self.process.stop()
            raise

    @property
    def url(self) -> str:
        return self.base_url

    @property
    def endpoint(self) -> "Runtime":
        """SGLang's Runtime wraps a RuntimeEndpoint here; this Runtime is one."""
        return self

    def shutdown(self) -> None:
        super().shutdown()
        self.process.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
