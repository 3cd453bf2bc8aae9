"""Request bodies of the OpenAI routes and the native /generate, and which fields each one takes.

Nothing a client sends is dropped without a word. Every field a body may hold is declared here, so:
- a field that is neither OpenAI's nor one of our extensions is a 400 naming it (`extra="forbid"`, turned into
  an OpenAI-shaped error by `request_error`), at every level: messages, content parts, tools, tool_choice,
  response_format, stream_options;
- an OpenAI field we do not implement is declared too: in IGNORED when ignoring it cannot change the answer
  (bookkeeping, billing and cache hints), in REFUSED with the reason when it would (a 400 naming it);
- our extensions (SGLang's and vLLM's sampling and constraint fields) are the fields under "extras" below.
OpenAI's lists are read from openai-python's request types (`types/chat/completion_create_params.py`,
`types/completion_create_params.py` and the message, content-part and tool types they use). Types are strict
("10" is not an integer)."""

from __future__ import annotations

import difflib
import typing
from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from radixlm.srt.errors import InvalidRequest


class UnknownField(InvalidRequest):
    code = "unknown_parameter"


class UnsupportedField(InvalidRequest):
    """An OpenAI field this server does not implement, refused because ignoring it would change the answer."""

    code = "unsupported_parameter"


class FieldError(ValueError):
    """Raised inside validation (pydantic turns a ValueError into one of its errors, keeping this object), so
    `request_error` can name `field`, relative to where the validator ran, in the client's own words. `kind`:
    unknown (not a field we know), refused (an OpenAI field we do not implement) or invalid."""

    def __init__(self, field: str, why: str = "", kind: str = "invalid"):
        super().__init__(why)
        self.field, self.why, self.kind = field, why, kind


# OpenAI fields accepted and not acted on: none can change an answer (bookkeeping, billing, cache hints).
IGNORED = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
)
# OpenAI chat fields refused when set: (why, the values that ask for nothing we lack).
REFUSED: dict[str, tuple[str, tuple]] = {
    "audio": ("this server answers in text only", ()),
    "modalities": ('this server answers in text only (modalities ["text"] is accepted)', (["text"],)),
    "prediction": ("predicted outputs are not implemented", ()),
    "functions": ("the deprecated functions API is not implemented; send tools", ()),
    "function_call": ("the deprecated function_call is not implemented; send tool_choice", ()),
    "web_search_options": ("this server has no web search", ()),
    "reasoning_effort": ('the model runs no reasoning budget (only "none" is accepted)', ("none",)),
    "verbosity": ("the answer's verbosity cannot be set", ()),
    "moderation": ("this server runs no moderation", ()),
}
# The same for a message's fields.
_MESSAGE_REFUSED: dict[str, tuple[str, tuple]] = {
    "audio": ("an earlier audio answer cannot be read by a text model", ()),
    "function_call": ("the deprecated function_call is not implemented; send tool_calls", ()),
}


def _refuse(req: BaseModel, table: dict[str, tuple[str, tuple]]) -> None:
    for name, (why, harmless) in table.items():
        value = getattr(req, name)
        if value is not None and value not in harmless:
            raise FieldError(name, why, "refused")


def _check_keys(obj, allowed: set[str], where: str) -> None:
    """Unknown keys of a nested object that is kept as a plain dict (the serving code reads it as one)."""
    if isinstance(obj, dict):
        for key in obj:
            if key not in allowed:
                raise FieldError(
                    f"{where}.{key}", f"{where.split('.')[-1]} takes {', '.join(sorted(allowed))}", kind="unknown"
                )


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # said after "unknown field X" (request_error)
    UNKNOWN_HINT: ClassVar[str] = ""


class StreamOptions(_Base):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: padding against length side channels, not content


class ResponseFormat(_Base):
    type: str
    json_schema: dict | None = None  # {"name", "description", "schema", "strict"}; always enforced strictly

    @model_validator(mode="after")
    def _keys(self):
        if self.json_schema is not None and self.type != "json_schema":
            raise FieldError("json_schema", f'only read with type "json_schema" (type is {self.type!r})')
        _check_keys(self.json_schema, {"name", "description", "schema", "strict"}, "json_schema")
        return self


# Null means "the default" for these, as in OpenAI's API; clients send them as null (LangChain sends
# `"logprobs": null` on /v1/completions).
_NULL_MEANS_DEFAULT = ("n", "stream", "logprobs", "echo")


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    UNKNOWN_HINT: ClassVar[str] = "it is neither an OpenAI field nor a radixlm extension"

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
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # ignored (IGNORED)
    # extras (SGLang's and vLLM's)
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

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_MEANS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in _NULL_MEANS_DEFAULT and v is None)}
        return data


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # refused when set (serving)
    best_of: int | None = None  # only equal to n (serving)


# Content parts: the keys of the kinds read here; other kinds (image_url, input_audio, file) are refused whole by
# the serving code, which reads content parts as dicts.
_PART_KEYS = {
    "text": {"type", "text", "prompt_cache_breakpoint"},  # the cache breakpoint is a hint: ignored
    "refusal": {"type", "refusal"},
}


class ChatMessage(_Base):
    UNKNOWN_HINT: ClassVar[str] = "messages take role, content, name, tool_calls, tool_call_id and refusal"

    role: str
    content: Union[str, list[dict], None] = None
    name: str | None = None  # given to the chat template, which renders it or not
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    refusal: str | None = None  # an assistant's earlier refusal: rendered as what it said
    audio: Any = None  # refused: an earlier audio answer
    function_call: Any = None  # refused: the deprecated form of tool_calls

    @model_validator(mode="after")
    def _keys(self):
        _refuse(self, _MESSAGE_REFUSED)
        if self.tool_call_id is not None and self.role != "tool":
            raise FieldError("tool_call_id", "only tool messages carry tool_call_id")
        if self.refusal is not None and self.role != "assistant":
            raise FieldError("refusal", "only assistant messages carry refusal")
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type")
            if kind in _PART_KEYS:
                _check_keys(part, _PART_KEYS[kind], f"content[{i}]")
        for i, call in enumerate(self.tool_calls or []):
            if isinstance(call, dict) and call.get("type", "function") == "function":
                _check_keys(call, {"id", "type", "function"}, f"tool_calls[{i}]")
                _check_keys(call.get("function"), {"name", "arguments"}, f"tool_calls[{i}].function")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    # An answer holds at most one call (srt/constrained/tool_grammar.py), which both values allow.
    parallel_tool_calls: bool | None = None
    # ignored (IGNORED)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    # refused when set (REFUSED)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    # extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _keys(self):
        _refuse(self, REFUSED)
        # Function tools' keys; other tool kinds (custom) and tool_choice forms are refused by tools.check_tools.
        for i, tool in enumerate(self.tools or []):
            if isinstance(tool, dict) and tool.get("type") == "function":
                _check_keys(tool, {"type", "function"}, f"tools[{i}]")
                # strict: arguments always follow the schema (the call is constrained)
                _check_keys(
                    tool.get("function"), {"name", "description", "parameters", "strict"}, f"tools[{i}].function"
                )
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            _check_keys(choice, {"type", "function"}, "tool_choice")
            _check_keys(choice.get("function"), {"name"}, "tool_choice.function")
        return self


class GenerateRequest(_Base):
    """The native /generate body (SGLang's shape); unknown sampling_params keys are refused by SamplingParams."""

    UNKNOWN_HINT: ClassVar[str] = (
        "/generate takes text, input_ids, sampling_params, stream, return_logprob, "
        "top_logprobs_num, logprob_start_len, return_text_in_logprobs and rid"
    )
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[dict, list[dict], None] = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    rid: Union[str, list[str], None] = None


class AbortRequest(_Base):
    rid: str = Field(min_length=1)


class ProfileRequest(_Base):
    """POST /start_profile: a torch.profiler run of the scheduler's steps (srt/diagnostics/profiler.py) until
    /stop_profile or `num_steps` steps; written under `output_dir` (default $RADIXLM_TORCH_PROFILER_DIR or /tmp).
    `activities`: CPU and/or GPU (default: both where there is a GPU)."""

    output_dir: Union[str, None] = Field(default=None, min_length=1)
    num_steps: Union[int, None] = Field(default=None, ge=1)
    activities: Union[list[str], None] = Field(default=None, min_length=1)
    record_shapes: bool = False


# --- validation errors, in the client's words ---------------------------------------------------------------
def _path(loc) -> str:
    """pydantic's location as the client wrote it: ("messages", 0, "content") -> messages[0].content."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(model: type[BaseModel], loc) -> type[BaseModel] | None:
    """The model class that holds the last key of `loc` (for "did you mean"), if one does."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        nested = [t for t in _leaf_types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def _leaf_types(tp):
    args = typing.get_args(tp)
    return [leaf for a in args for leaf in _leaf_types(a)] if args else [tp]


def _unknown(model: type[BaseModel], loc: tuple) -> UnknownField:
    path, key = _path(loc), loc[-1]
    holder = _model_at(model, loc)
    msg = f"unknown field {path!r}"
    if key == "extra_body":
        msg += ": extra_body is an option of the client; its fields go at the top level of the body"
    elif holder is not None:
        close = difflib.get_close_matches(str(key), [k for k in holder.model_fields if k not in REFUSED], n=1)
        msg += f"; did you mean {close[0]!r}?" if close else (f": {holder.UNKNOWN_HINT}" if holder.UNKNOWN_HINT else "")
    return UnknownField(msg, param=path)


def request_error(model: type[BaseModel], e: ValidationError) -> InvalidRequest:
    """The first problem of a body as an OpenAI-shaped 400 naming its field. Unknown fields come first: a
    misspelt name often explains the rest (`message` for `messages` also leaves `messages` missing)."""
    errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
    err = errors[0]
    if err["type"] == "extra_forbidden":
        return _unknown(model, err["loc"])
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        path = _path((*err["loc"], cause.field))
        if cause.kind == "unknown":
            return UnknownField(f"unknown field {path!r}: {cause.why}", param=path)
        if cause.kind == "refused":
            return UnsupportedField(f"{path} is not supported: {cause.why}", param=path)
        return InvalidRequest(f"{path}: {cause.why}", param=path)
    path = _path(err["loc"])
    return InvalidRequest(f"{path}: {err['msg']}" if path else err["msg"], param=path or None)
