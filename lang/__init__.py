"""The frontend language: `@function` programs with gen, select, fork and role blocks, run on a backend.

import radixlm as sgl

@sgl.function
def qa(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=64))

sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
print(qa.run(question="What is the capital of France?")["answer"])
"""

from radixlm.lang.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    image,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.lang.backend.base import Backend, LangError, TokenUsage
from radixlm.lang.backend.native import EngineBackend, Runtime, RuntimeEndpoint
from radixlm.lang.backend.openai_backend import OpenAI
from radixlm.lang.fork import ForkGroup
from radixlm.lang.function import SglFunction, function
from radixlm.lang.global_config import global_config
from radixlm.lang.interpreter import ProgramState
from radixlm.lang.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

__all__ = [
    "Backend",
    "EngineBackend",
    "ForkGroup",
    "LangError",
    "OpenAI",
    "ProgramState",
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Runtime",
    "RuntimeEndpoint",
    "SglFunction",
    "TokenUsage",
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
]
