"""OpenAI function calling: validating `tools` / `tool_choice`, rendering tool conversations through the chat
template, the grammar that keeps a call valid, and reading calls back out of the answer.

Calls are written in the Hermes/Qwen format (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
see srt/constrained/tool_grammar.py). A chat template that renders `tools` itself is given them; for one that
does not (SmolLM2's), the tools are described in the system message and past calls and results are written
in the same tags, so the model sees one consistent format."""

from __future__ import annotations

import json
import re
import uuid

# Imported at module level: a machine without jsonschema fails at start-up, not per schema request.
from jsonschema import Draft202012Validator, SchemaError

from radixlm.srt.constrained.spec import MAX_SCHEMA_DEPTH, json_depth
from radixlm.srt.constrained.tool_grammar import BEGIN, END
from radixlm.srt.errors import InvalidRequest

_MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names


def check_tools(tools: list | None, tool_choice) -> tuple[list[dict], str, str | None]:
    """Returns (functions, mode, forced name): mode is none | auto | required | named."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return [], "none", None
    if not isinstance(tools, list) or not tools or len(tools) > _MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of 1 to {_MAX_TOOLS} tools", param="tools")
    funcs, names = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param=f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                param=f"tools[{i}].function.name",
            )
        if name in names:
            raise InvalidRequest(f"tools[{i}]: function name {name!r} appears twice", param=f"tools[{i}].function.name")
        params = f.get("parameters", {"type": "object", "properties": {}})
        # Arguments are a JSON object (OpenAI's contract, and what a call's `arguments` string decodes to): a schema
        # of any other type could never be answered with a call.
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidRequest(
                f'tools[{i}].function.parameters must be a JSON schema of type "object"',
                param=f"tools[{i}].function.parameters",
            )
        params = {"type": "object", **params}
        if json_depth(params) > MAX_SCHEMA_DEPTH - 8:  # the call schema wraps it a few levels deeper
            raise InvalidRequest(
                f"tools[{i}].function.parameters nests deeper than {MAX_SCHEMA_DEPTH - 8} levels",
                param=f"tools[{i}].function.parameters",
            )
        _check_schema(params, f"tools[{i}].function.parameters")
        names.add(name)
        funcs.append({"name": name, "description": f.get("description", ""), "parameters": params})
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return funcs, tool_choice or "auto", None
    if (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice"
            )
        return funcs, "named", name
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _check_schema(schema: dict, where: str) -> None:
    """A parameters schema must be a valid JSON Schema, and one some arguments satisfy."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise InvalidRequest(
            f"{where} is not a valid JSON schema: at {e.json_path}: {e.message}", param=where
        ) from None
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("enum") == []:  # admits no value at all: no call could ever be valid
                raise InvalidRequest(f"{where}: an empty enum admits no value", param=where)
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and not _resolves(schema, ref):
                raise InvalidRequest(f"{where}: $ref {ref!r} points at nothing in the schema", param=where)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _resolves(schema: dict, ref: str) -> bool:
    node = schema
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def call_schema(funcs: list[dict]) -> dict:
    """One call of any of `funcs`: {"name": <that name>, "arguments": <its parameters>}."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in funcs
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def tool_grammar(funcs: list[dict], mode: str, name: str | None) -> str | None:
    """The `tool_call` grammar spec for a request, or None (tool_choice none)."""
    if mode == "none":
        return None
    chosen = [f for f in funcs if f["name"] == name] if mode == "named" else funcs
    return json.dumps({"mode": "auto" if mode == "auto" else "call", "schema": call_schema(chosen)})


def template_takes_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render_messages(messages: list[dict], funcs: list[dict], own_template: bool) -> list[dict]:
    """Messages for a template that knows nothing of tools: the tool list joins the system message, past
    calls and results become tagged text."""
    if own_template:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f"{BEGIN}{json.dumps({'name': c['name'], 'arguments': c['arguments']})}{END}" for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if funcs:
        listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in funcs)
        text = (
            "You can call functions. Their signatures are inside <tools></tools>:\n<tools>\n"
            + listing
            + "\n</tools>\nTo call one, answer with a JSON object holding its name and arguments inside "
            "<tool_call></tool_call> tags:\n" + BEGIN + '{"name": <function-name>, "arguments": <args-object>}' + END
        )
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def parse_tool_calls(text: str, funcs: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from an answer: calls are the tagged blocks whose JSON names a known function."""
    known = {f["name"] for f in funcs}
    calls, rest, pos = [], [], 0
    while True:
        start = text.find(BEGIN.strip(), pos)
        if start < 0:
            rest.append(text[pos:])
            break
        end = text.find(END.strip(), start)
        if end < 0:
            rest.append(text[pos:])
            break
        body = text[start + len(BEGIN.strip()) : end].strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and obj.get("name") in known and isinstance(obj.get("arguments", {}), dict):
            rest.append(text[pos:start])
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))},
                }
            )
        else:
            rest.append(text[pos : end + len(END.strip())])
        pos = end + len(END.strip())
    content = "".join(rest).strip()
    return (content or None), calls
