"""The constraint fields of the OpenAI routes (response_format, tools, SGLang's json_schema / regex / ebnf, vLLM's
guided_* and structured_outputs) as the sampling parameters that carry a grammar: at most one per request, and
errors under the name of the field the client used."""

from __future__ import annotations

from radixlm.srt.entrypoints.openai import tools as tooling
from radixlm.srt.errors import InvalidRequest, RadixLMError

_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "regex", "grammar": "ebnf"}


def _choices(choices, field: str) -> str | None:
    """vLLM's guided_choice: the answer is exactly one of these strings (as a regex)."""
    if choices is None:
        return None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest(f"{field} must be a non-empty list of non-empty strings", param=field)
    from radixlm.srt.constrained.outlines_backend import choices_regex

    return choices_regex(choices)


def grammar_fields(
    req, mode: str = "none", funcs: list[dict] | None = None, name: str | None = None
) -> tuple[dict, str | None]:
    """Sampling parameters for response_format, tools and the other constraint fields (SGLang's json_schema /
    regex / ebnf, vLLM's guided_* and structured_outputs), at most one of them; and the request field it came
    from, which errors about it name."""
    so = req.structured_outputs or {}
    unknown = sorted(set(so) - set(_STRUCTURED_OUTPUTS))
    if unknown:
        raise InvalidRequest(
            f"structured_outputs: unknown field(s) {', '.join(unknown)} (supported: {', '.join(_STRUCTURED_OUTPUTS)})",
            param="structured_outputs",
        )
    given = {  # request field -> (grammar kind, value)
        "json_schema": ("json_schema", req.json_schema),
        "regex": ("regex", req.regex),
        "ebnf": ("ebnf", req.ebnf),
        "guided_json": ("json_schema", req.guided_json),
        "guided_regex": ("regex", req.guided_regex),
        "guided_choice": ("regex", _choices(req.guided_choice, "guided_choice")),
        "guided_grammar": ("ebnf", req.guided_grammar),
        **{
            f"structured_outputs.{k}": (
                _STRUCTURED_OUTPUTS[k],
                v if k != "choice" else _choices(v, "structured_outputs.choice"),
            )
            for k, v in so.items()
        },
    }
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(
                    "response_format.json_schema.schema must be a JSON schema object", param="response_format"
                )
            given["response_format"] = ("json_schema", schema)
        elif rf.type == "json_object":
            given["response_format"] = ("json_schema", {"type": "object"})
        elif rf.type != "text":
            raise InvalidRequest(
                f"response_format.type must be text, json_object or json_schema, got {rf.type!r}",
                param="response_format",
            )
    spec = tooling.tool_grammar(funcs or [], mode, name)
    if spec is not None:
        given["tools"] = ("tool_call", spec)
    used = [(field, kind, value) for field, (kind, value) in given.items() if value is not None]
    if len(used) > 1:
        fields = [u[0] for u in used]
        if "tools" in fields:
            raise InvalidRequest(
                "tools cannot be combined with response_format or another grammar; use "
                'tool_choice "none" for a constrained text answer',
                param="tools",
            )
        raise InvalidRequest(f"give at most one constraint (got {', '.join(fields)})", param=fields[1])
    return {kind: value for _, kind, value in used}, (used[0][0] if used else None)


def grammar_param(field: str | None, err: RadixLMError) -> RadixLMError:
    """A grammar refused under the name of the request field the client sent it in (response_format,
    guided_json, ...), not the sampling parameter it became."""
    if field is not None and err.param in ("json_schema", "regex", "ebnf"):
        err.param = field
    return err
