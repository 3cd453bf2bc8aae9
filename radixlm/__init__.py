"""radixlm: an LLM serving runtime with a radix-tree prefix cache.

Public API only; the rooms live in radixlm.srt (serving runtime), radixlm.lang (frontend DSL) and
radixlm.kernels (GPU kernels).
"""

from __future__ import annotations

import os as _os

# A source checkout used without `pip install`: the rooms sit beside this package at the repo root.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "srt", "__init__.py")) and _root not in __path__:
    __path__.append(_root)

__version__ = "0.1.0"

# Before anything imports torch: OpenMP reads its wait policy once, when it loads (see srt/cpu_threads.py).
from radixlm.srt.cpu_threads import set_wait_policy_default as _set_wait_policy_default  # noqa: E402

_set_wait_policy_default()

_LANG = (
    "Backend",
    "EngineBackend",
    "LangError",
    "OpenAI",
    "ProgramState",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
)
__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__", *_LANG]


def __getattr__(name: str):
    # Lazy so `import radixlm` stays cheap (torch and transformers load only when used).
    if name == "Engine":
        from radixlm.srt.entrypoints.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixlm.srt.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from radixlm.srt.server_args import ServerArgs

        return ServerArgs
    if name in _LANG:  # the frontend language: `import radixlm as sgl` runs SGLang-style programs
        import radixlm.lang as lang

        return getattr(lang, name)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
