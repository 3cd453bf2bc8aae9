"""The frontend language: `@function` programs with gen, select, fork and role blocks, run on a backend.

    import radixlm as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])
"""
from radixlm.lang.api import (SglFunction, assistant, assistant_begin, assistant_end, function, gen, gen_int,
                              gen_string, get_default_backend, image, select, set_default_backend, system,
                              system_begin, system_end, user, user_begin, user_end)
from radixlm.lang.backend.base import Backend, LangError
from radixlm.lang.backend.native import EngineBackend, Runtime, RuntimeEndpoint
from radixlm.lang.backend.openai_backend import OpenAI
from radixlm.lang.interpreter import ForkGroup, ProgramState
from radixlm.lang.ir import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized

__all__ = ["Backend", "EngineBackend", "ForkGroup", "LangError", "OpenAI", "ProgramState", "Runtime",
           "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin", "assistant_end", "function", "gen",
           "gen_int", "gen_string", "get_default_backend", "greedy_token_selection", "image", "select",
           "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
           "unconditional_likelihood_normalized", "user", "user_begin", "user_end"]
