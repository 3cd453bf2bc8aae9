"""The public language: the primitives, role helpers, the default backend and server calls.

Written so that a program for SGLang's frontend runs after `import radixlm as sgl`: `gen`, `gen_int`,
`gen_string` and `select` take SGLang's arguments in SGLang's positional order; radixlm's extras are
keyword-only after them.
"""

from __future__ import annotations

from radixlm.lang.backend.base import Backend
from radixlm.lang.function import SglFunction, as_backend, function  # noqa: F401  (re-exported)
from radixlm.lang.global_config import global_config
from radixlm.lang.ir import Gen, Image, Role, RoleBegin, RoleEnd, Select, token_length_normalized


def set_default_backend(backend) -> None:
    """The backend programs use when `run` is given none: a Backend, or a radixlm.Engine to run in-process."""
    global_config.default_backend = backend


def get_default_backend() -> Backend | None:
    return global_config.default_backend


def flush_cache(backend=None) -> bool:
    """Empty the server's prefix cache; False when there is no backend or requests are still running."""
    backend = backend or global_config.default_backend
    return False if backend is None else as_backend(backend).flush_cache()


def get_server_info(backend=None) -> dict | None:
    backend = backend or global_config.default_backend
    return None if backend is None else as_backend(backend).get_server_info()


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype=None,
    choices: list[str] | None = None,
    choices_method=None,
    regex: str | None = None,
    json_schema=None,
    *,
    repetition_penalty: float | None = None,
    seed: int | None = None,
) -> Gen:
    """Generate into variable `name`. `dtype` (int, float, str, bool) constrains the text to SGLang's pattern
    for it (ir.REGEX_*); `choices` makes it a select."""
    # (a regex is checked by the server, whose grammar engines accept more than Python's `re`)
    return Gen(
        name=name,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        n=n,
        stop=stop,
        stop_token_ids=stop_token_ids,
        stop_regex=stop_regex,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        dtype=dtype,
        regex=regex,
        json_schema=json_schema,
        choices=choices,
        choices_method=choices_method or token_length_normalized,
    )


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop=None,
    stop_token_ids: list[int] | None = None,
    stop_regex=None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    *,
    min_tokens: int | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
) -> Gen:
    """An integer: `gen(dtype=int)`, which ends at the first space or newline."""
    return gen(
        name,
        max_tokens,
        min_tokens,
        n,
        stop,
        stop_token_ids,
        stop_regex,
        temperature,
        top_p,
        top_k,
        min_p,
        frequency_penalty,
        presence_penalty,
        ignore_eos,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        int,
        repetition_penalty=repetition_penalty,
        seed=seed,
    )


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop=None,
    stop_token_ids: list[int] | None = None,
    stop_regex=None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    *,
    min_tokens: int | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
) -> Gen:
    """A double-quoted string of word characters and spaces: `gen(dtype=str)`."""
    return gen(
        name,
        max_tokens,
        min_tokens,
        n,
        stop,
        stop_token_ids,
        stop_regex,
        temperature,
        top_p,
        top_k,
        min_p,
        frequency_penalty,
        presence_penalty,
        ignore_eos,
        return_logprob,
        logprob_start_len,
        top_logprobs_num,
        return_text_in_logprobs,
        str,
        repetition_penalty=repetition_penalty,
        seed=seed,
    )


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method=token_length_normalized,
) -> Select:
    return Select(name, list(choices) if isinstance(choices, (list, tuple)) else choices, choices_method, temperature)


def image(path: str) -> Image:
    return Image(path)


def video(path: str, num_frames: int) -> Image:
    """Video input: radixlm serves text-only models, so a program that appends one fails with a clear error."""
    return Image(f"{path} (video, {num_frames} frames)")


def _role(role: str, content) -> Role:
    return Role(role, [content])


def system(content="") -> Role:
    return _role("system", content)


def user(content="") -> Role:
    return _role("user", content)


def assistant(content="") -> Role:
    return _role("assistant", content)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
