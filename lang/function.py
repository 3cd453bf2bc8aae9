"""`@function` programs: `prog.run(...)` once, `prog.run_batch([...])` many at once.

`run` and `run_batch` take SGLang's keywords (the sampling defaults for every gen of the program, `stream`,
`backend`, `use_thread`, `num_threads`, `progress_bar`, `generator_style`) plus radixlm's own sampling extras
(`min_new_tokens`, `repetition_penalty`, `seed`); every other keyword is an argument of the program, checked
against its signature before anything runs.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from radixlm.lang.backend.base import Backend, LangError
from radixlm.lang.global_config import global_config, to_backend
from radixlm.lang.interpreter import ProgramState

_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def as_backend(backend) -> Backend:
    if backend is None:
        if global_config.default_backend is None:
            raise LangError("no backend: pass backend=... to run(), or call set_default_backend(...) first")
        return global_config.default_backend
    if hasattr(backend, "endpoint") and not isinstance(backend, Backend):  # an SGLang-style Runtime wrapper
        backend = backend.endpoint
    return to_backend(backend)


def _defaults(**sampling) -> dict:
    """The program-wide gen defaults run()/run_batch() were given (unset ones are left to the server)."""
    return {k: v for k, v in sampling.items() if v is not None}


class SglFunction:
    def __init__(self, func, num_api_spec_tokens: int | None = None, bind_arguments: dict | None = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__
        self._sig = inspect.signature(func)
        params = list(self._sig.parameters.values())
        if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, *_KEYWORD):
            raise LangError(
                f"program {self.__name__} must take the state as its first argument: def {self.__name__}(s, ...)"
            )
        self._params = params[1:]
        self.arg_names = [p.name for p in self._params if p.kind in _KEYWORD or p.kind == p.POSITIONAL_ONLY]
        self.arg_defaults = [p.default for p in self._params if p.default is not p.empty]

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)

    def bind(self, **kwargs) -> "SglFunction":
        """The same program with some arguments fixed."""
        self._check_args((), kwargs, partial=True)
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _describe(self) -> str:
        return f"{self.__name__}({', '.join(str(p) for p in self._params)})"

    def _check_args(self, args: tuple, kwargs: dict, partial: bool = False) -> None:
        """A clear TypeError for arguments the program cannot take, before it runs (not one from inside it)."""
        takes_any = any(p.kind == p.VAR_KEYWORD for p in self._params)
        named = {p.name for p in self._params if p.kind in _KEYWORD}
        unknown = [k for k in kwargs if k not in named]
        if unknown and not takes_any:
            raise TypeError(
                f"{self.__name__}.run() got an unexpected keyword argument {unknown[0]!r}: it is neither "
                f"an option of run() nor an argument of the program {self._describe()}"
            )
        try:
            (self._sig.bind_partial if partial else self._sig.bind)(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.__name__}.run(): {e} (the program is {self._describe()})") from None

    def _state(self, backend: Backend, defaults: dict, stream: bool = False, use_thread: bool = True):
        return ProgramState(
            backend, defaults, stream=stream, use_thread=use_thread, num_api_spec_tokens=self.num_api_spec_tokens
        )

    def _execute(self, state: ProgramState, args, kwargs) -> None:
        try:
            state.ret_value = self.func(state, *args, **kwargs)
            state.sync()
        except BaseException as e:
            if state.error is None:
                state.error = e
        finally:
            state._mark_finished()
            if global_config.verbosity >= 2 and state.error is None:
                print(state._text)

    def run(
        self,
        *args,
        max_new_tokens: int | None = 128,
        n: int | None = None,
        stop=None,
        stop_token_ids=None,
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
        stream: bool = False,
        backend=None,
        use_thread: bool = True,
        min_new_tokens: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        **kwargs,
    ) -> ProgramState:
        """Run the program once. The sampling keywords are defaults for each of its gens (a gen's own settings
        win); with stream=True it returns at once, to be followed with `state.text_iter()`."""
        defaults = _defaults(
            max_new_tokens=max_new_tokens,
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
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            min_new_tokens=min_new_tokens,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
        kwargs = {**self.bind_arguments, **kwargs}
        self._check_args(args, kwargs)
        state = self._state(as_backend(backend), defaults, stream, use_thread)
        if stream:
            threading.Thread(target=self._execute, args=(state, args, kwargs), daemon=True).start()
            return state
        self._execute(state, args, kwargs)
        if state.error is not None:
            raise state.error
        return state

    def run_batch(
        self,
        batch_kwargs,
        *,
        max_new_tokens: int | None = 128,
        n: int | None = None,
        stop=None,
        stop_token_ids=None,
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
        backend=None,
        num_threads="auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        min_new_tokens: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per entry (a dict of arguments, or a tuple of them in order), concurrently. A
        program that fails has its error on its state (`state.error`); the others are unaffected. With
        generator_style=True the states come one by one, in order, as they finish."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise LangError("run_batch takes a list of dicts (or tuples) of program arguments")
        batch = [self._batch_entry(i, entry) for i, entry in enumerate(batch_kwargs)]
        defaults = _defaults(
            max_new_tokens=max_new_tokens,
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
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            min_new_tokens=min_new_tokens,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
        be = as_backend(backend)
        if num_threads == "auto":
            num_threads = min(64, 4 * (os.cpu_count() or 1))
        num_threads = max(1, min(int(num_threads), len(batch) or 1))
        states = [(self._state(be, defaults), kw) for kw in batch]
        it = self._iterate(states, num_threads, progress_bar)
        return it if generator_style else list(it)

    def _batch_entry(self, i: int, entry) -> dict:
        if isinstance(entry, (list, tuple)):  # positional, in the program's order (SGLang accepts both)
            if len(entry) > len(self.arg_names):
                raise TypeError(f"run_batch entry {i}: {len(entry)} values for {self._describe()}")
            entry = dict(zip(self.arg_names, entry))
        if not isinstance(entry, dict):
            raise LangError(f"run_batch entry {i} is a {type(entry).__name__}: give a dict (or tuple) of arguments")
        kw = {**self.bind_arguments, **entry}
        self._check_args((), kw)
        return kw

    def _iterate(self, states: list, num_threads: int, progress_bar: bool) -> Iterator[ProgramState]:
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(states), desc=self.__name__)
        try:
            with ThreadPoolExecutor(max_workers=num_threads) as pool:
                futures = [pool.submit(self._execute, st, (), kw) for st, kw in states]
                for (st, _), f in zip(states, futures):
                    f.result()
                    if bar:
                        bar.update(1)
                    yield st
        finally:
            if bar:
                bar.close()


def function(func=None, num_api_spec_tokens: int | None = None):
    """`@function`, `@function()` or `@function(num_api_spec_tokens=N)`: turn `def prog(s, ...)` into a
    runnable program (see lang/speculative.py for what N does)."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)
