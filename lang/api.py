"""The public language: `@function`, the primitives, role helpers and the default backend.

Written so that a program for SGLang's frontend runs after `import radixlm as sgl`.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from radixlm.lang.backend.base import Backend, LangError
from radixlm.lang.interpreter import ProgramState
from radixlm.lang.ir import (Gen, Image, Role, RoleBegin, RoleEnd, Select, token_length_normalized)

# sampling keywords `run`/`run_batch` take as defaults for every gen of the program
_SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                  "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed"}
_default_backend: Backend | None = None


def set_default_backend(backend) -> None:
    """The backend programs use when `run` is given none: a Backend, or a radixlm.Engine to run in-process."""
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


def as_backend(backend) -> Backend:
    if backend is None:
        if _default_backend is None:
            raise LangError("no backend: pass backend=... to run(), or call set_default_backend(...) first")
        return _default_backend
    if isinstance(backend, Backend):
        return backend
    if type(backend).__name__ == "Engine" and hasattr(backend, "add_request"):
        from radixlm.lang.backend.native import EngineBackend

        return EngineBackend(backend)
    raise LangError(f"not a backend: {type(backend).__name__} (use RuntimeEndpoint, Runtime, OpenAI or an Engine)")


class SglFunction:
    """A program: `prog.run(...)` runs it once, `prog.run_batch([...])` many at once."""

    def __init__(self, func, num_api_spec_tokens=None):
        self.func = func
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)

    def _split(self, kwargs: dict) -> tuple[dict, dict]:
        sampling = {k: v for k, v in kwargs.items() if k in _SAMPLING_KEYS and v is not None}
        sampling.setdefault("max_new_tokens", 128)
        return {k: v for k, v in kwargs.items() if k not in _SAMPLING_KEYS}, sampling

    def _execute(self, state: ProgramState, args, kwargs) -> None:
        try:
            state.ret_value = self.func(state, *args, **kwargs)
            state.sync()
        except BaseException as e:
            if state.error is None:
                state.error = e
        finally:
            state._mark_finished()

    def run(self, *args, backend=None, stream: bool = False, **kwargs) -> ProgramState:
        """Run the program; with stream=True return at once and follow it with `state.text_iter()`."""
        program_kwargs, sampling = self._split(kwargs)
        state = ProgramState(as_backend(backend), sampling, stream=stream)
        if stream:
            import threading

            threading.Thread(target=self._execute, args=(state, args, program_kwargs), daemon=True).start()
            return state
        self._execute(state, args, program_kwargs)
        if state.error is not None:
            raise state.error
        return state

    def run_batch(self, batch_kwargs: list[dict], *, backend=None, num_threads="auto", progress_bar: bool = False,
                  **sampling_kwargs) -> list[ProgramState]:
        """Run the program once per dict of arguments, concurrently. A program that fails has its error on
        its state (`state.error`); the others are unaffected."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise LangError("run_batch takes a list of dicts of program arguments")
        be = as_backend(backend)
        if num_threads == "auto":
            num_threads = max(1, min(64, len(batch_kwargs), 4 * (os.cpu_count() or 1)))
        states = []
        for kw in batch_kwargs:
            program_kwargs, sampling = self._split({**sampling_kwargs, **kw})
            states.append((ProgramState(be, sampling), program_kwargs))
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(states), desc=self.__name__)
        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            futures = [pool.submit(self._execute, st, (), kw) for st, kw in states]
            for f in futures:
                f.result()
                if bar:
                    bar.update(1)
        if bar:
            bar.close()
        return [st for st, _ in states]


def function(func=None, *, num_api_spec_tokens=None):
    """`@function` (or `@function()`): turn `def prog(s, ...)` into a runnable program."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)


def gen(name: str | None = None, max_tokens: int | None = None, stop=None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, regex: str | None = None, json_schema=None, choices=None,
        choices_method=token_length_normalized, **more) -> Gen:
    unknown = set(more) - {"min_tokens", "stop_token_ids", "repetition_penalty", "seed"}
    if unknown:
        raise LangError(f"gen() got unknown argument(s): {', '.join(sorted(unknown))}")
    return Gen(name, max_tokens, more.get("min_tokens"), stop, more.get("stop_token_ids"), temperature, top_p, top_k,
               min_p, frequency_penalty, presence_penalty, more.get("repetition_penalty"), ignore_eos,
               more.get("seed"), regex, json_schema, choices, choices_method)


def gen_int(name: str | None = None, **kwargs) -> Gen:
    return gen(name, regex=r"-?\d+", **kwargs)


def gen_string(name: str | None = None, **kwargs) -> Gen:
    return gen(name, regex=r'"[^"\n]*"', **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method=token_length_normalized) -> Select:
    return Select(name, list(choices) if isinstance(choices, (list, tuple)) else choices, choices_method,
                  temperature)


def image(path: str) -> Image:
    return Image(path)


def _role(role: str, content) -> Role | RoleBegin:
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
