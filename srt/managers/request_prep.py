"""Turn user inputs (text or token ids, single or batch, sampling dicts) into scheduler requests.

Shared by the in-process Engine and the server's TokenizerManager so both validate identically.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from radixlm.srt.errors import ContextLengthExceeded, InvalidRequest
from radixlm.srt.sampling.sampling_params import SamplingParams
from radixlm.srt.scheduler.req import Req

_SEED_MASK = (1 << 63) - 1


@dataclass
class PreparedInput:
    """One prompt of a (possibly batched) call, before `n` expansion."""

    input_ids: list[int]
    text: str | None
    params: SamplingParams


def normalize_inputs(prompt=None, input_ids=None) -> tuple[list[str | list[int]], bool]:
    """Returns (list of prompts, each text or token ids; whether the caller passed a batch)."""
    if prompt is not None and input_ids is not None:
        raise InvalidRequest("give either a prompt or input_ids, not both", param="input_ids")
    value = input_ids if input_ids is not None else prompt
    if value is None:
        raise InvalidRequest("a prompt (text) or input_ids is required", param="prompt")
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list) and value and all(_is_token(t) for t in value):
        return [value], False
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, str) or (isinstance(v, list) and all(_is_token(t) for t in v)) for v in value)
    ):
        return list(value), True
    if isinstance(value, list) and not value:
        raise InvalidRequest("the prompt is empty", param="prompt")
    raise InvalidRequest(
        "prompt must be a string, a list of strings, a list of token ids, or a list of such lists", param="prompt"
    )


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def per_prompt_params(sampling_params, count: int) -> list[SamplingParams]:
    if isinstance(sampling_params, list):
        if len(sampling_params) != count:
            raise InvalidRequest(
                f"got {len(sampling_params)} sampling_params for {count} prompts", param="sampling_params"
            )
        return [_params(p) for p in sampling_params]
    one = _params(sampling_params)
    return [one] * count


def _params(p) -> SamplingParams:
    if isinstance(p, SamplingParams):
        p.validate()
        return p
    if p is not None and not isinstance(p, dict):
        raise InvalidRequest("sampling_params must be an object", param="sampling_params")
    return SamplingParams.from_dict(p)


def tokenize(tokenizer, prompt: str | list[int]) -> tuple[list[int], str | None]:
    """Token ids of a prompt given as text or as ids, and its text (None for ids)."""
    if not prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"], prompt
    return list(prompt), None


def check_text(text: str, param: str) -> None:
    """Lone surrogates (from JSON escapes like \\ud800) cannot be tokenized: reject them by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{param} contains invalid Unicode (a lone surrogate)", param=param) from None


def check_logprob_args(return_logprob: bool, top_logprobs_num: int, logprob_start_len: int) -> None:
    if not isinstance(return_logprob, bool):
        raise InvalidRequest("return_logprob must be a boolean", param="return_logprob")
    if not _is_token(top_logprobs_num) or not 0 <= top_logprobs_num <= 20:
        raise InvalidRequest("top_logprobs_num must be an integer in [0, 20]", param="top_logprobs_num")
    if not _is_token(logprob_start_len) or logprob_start_len < -1:
        raise InvalidRequest("logprob_start_len must be an integer >= -1", param="logprob_start_len")


def stop_token_ids(params: SamplingParams, eos_ids: list[int]) -> frozenset[int]:
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= set(eos_ids)
    return frozenset(ids)


def expand(
    prepared: PreparedInput,
    *,
    rid: str | None,
    eos_ids: list[int],
    rng: random.Random,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    logprob_start_len: int = -1,
    stream: bool = False,
    grammar_backend: str | None = None,
) -> list[Req]:
    """One Req per sample (`n`); samples of one prompt share its KV through the radix cache. With
    `grammar_backend`, a grammar that backend cannot enforce is rejected here (400 naming the feature)."""
    p = prepared.params
    spec = p.grammar()
    if spec is not None and grammar_backend is not None:
        from radixlm.srt.constrained.spec import check_supported

        check_supported(spec, grammar_backend)
    base = rid or uuid.uuid4().hex
    reqs = []
    for i in range(p.n):
        if p.seed is None:
            seed = rng.getrandbits(63)
        else:  # sample 0 keeps the user's seed so n=1 and n>1 agree on the first choice
            seed = (p.seed ^ (i * 0x9E3779B97F4A7C15)) & _SEED_MASK
        reqs.append(
            Req(
                rid=base if p.n == 1 else f"{base}-{i}",
                input_ids=prepared.input_ids,
                sampling_params=p,
                seed=seed,
                stop_token_ids=stop_token_ids(p, eos_ids),
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num if return_logprob else 0,
                logprob_start_len=logprob_start_len if return_logprob else -1,
                stream=stream,
                grammar_spec=spec,
            )
        )
    return reqs


def check_request_limits(
    input_ids: list[int], params: SamplingParams, context_length: int, kv_size: int, vocab_size: int
) -> int:
    """Validate a prompt and its parameters against the model and the KV cache; returns the resolved
    max_new_tokens."""
    n, requested = len(input_ids), params.max_new_tokens
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab_size})", param="logit_bias")
    if n == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if any(not (_is_token(t) and 0 <= t < vocab_size) for t in input_ids):
        raise InvalidRequest(f"input_ids must be token ids in [0, {vocab_size})", param="input_ids")
    if n >= context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens; the prompt has {n} tokens "
            "and no room is left for generation.",
            param="prompt",
        )
    if requested is None:
        max_new = context_length - n
    elif n + requested > context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{n + requested} tokens ({n} in the prompt, {requested} for the completion).",
            param="max_tokens",
        )
    else:
        max_new = requested
    if n + max_new > kv_size:
        raise InvalidRequest(
            f"the request needs up to {n + max_new} KV cache slots but the cache holds {kv_size}; lower max_tokens",
            param="max_tokens",
        )
    return max_new
