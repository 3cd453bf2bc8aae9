"""OpenAI-compatible request bodies. Types are strict ("10" is not an integer); unknown fields are ignored, as
OpenAI-compatible servers do for vendor extras sent through `extra_body`."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Base):
    include_usage: bool = False


class ResponseFormat(_Base):
    type: str
    json_schema: dict | None = None  # {"name", "schema", "strict"}


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions, including the usual vLLM/SGLang extras."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    # constrained decoding, on both routes: OpenAI's response_format, SGLang's fields, vLLM's guided_* fields and
    # its structured_outputs object ({"json" | "regex" | "choice" | "grammar": ...})
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Union[dict, str, None] = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: str
    # Parts are checked by the server (a clear 400 for image parts) rather than by the schema.
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class GenerateRequest(_Base):
    """The native /generate body (SGLang's shape)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict, list[dict], None] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: Union[str, list[str], None] = None


class AbortRequest(_Base):
    rid: str = Field(min_length=1)
