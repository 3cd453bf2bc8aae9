"""Chat messages as clients send them (OpenAI's roles, content parts, tool calls and tool results) checked and
turned into what a chat template renders; errors name the field (`messages[2].content[0]`)."""

from __future__ import annotations

import json

from radixlm.srt.entrypoints.openai.protocol import UnsupportedField
from radixlm.srt.errors import InvalidRequest
from radixlm.srt.managers.request_prep import check_text

ROLES = {"system", "user", "assistant", "developer", "tool"}


def chat_message(i: int, m, own_template: bool) -> dict:
    """messages[i] checked and turned into the dict the chat template renders (`own_template`: the tokenizer's template
    takes tools itself, so tool calls keep OpenAI's nesting)."""
    where = f"messages[{i}]"
    if m.role not in ROLES:
        raise InvalidRequest(
            f"{where}.role: unsupported role {m.role!r} (supported: {', '.join(sorted(ROLES))})",
            param=f"{where}.role",
        )
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "refusal" and m.role == "assistant" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])  # what the assistant said, as the model should see it
            elif kind in ("image_url", "input_image", "image", "input_audio", "file"):
                raise UnsupportedField(
                    f"{where}.content[{j}] is not supported: this model takes text only ({kind} parts)",
                    param=f"{where}.content[{j}]",
                )
            else:
                raise InvalidRequest(
                    f'{where}.content[{j}] must be {{"type": "text", "text": ...}}', param=f"{where}.content"
                )
        content = "".join(texts)
    else:
        content = m.content
    if m.refusal:  # an earlier answer's refusal (OpenAI returns it beside a null content): what it said
        content = f"{content}\n{m.refusal}" if content else m.refusal
    if m.role == "tool" and not (isinstance(m.tool_call_id, str) and m.tool_call_id):
        raise InvalidRequest(
            f"{where}.tool_call_id is required on tool messages (the id of the call it answers)",
            param=f"{where}.tool_call_id",
        )
    calls = []
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise InvalidRequest(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        for j, c in enumerate(m.tool_calls):
            f = c.get("function") if isinstance(c, dict) else None
            args = f.get("arguments") if isinstance(f, dict) else None
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(parsed, dict):
                raise InvalidRequest(
                    f"{where}.tool_calls[{j}] must hold function.name and function.arguments "
                    "(a JSON object as a string)",
                    param=f"{where}.tool_calls",
                )
            calls.append({"name": f["name"], "arguments": parsed})
    if content is None and not calls:
        raise InvalidRequest(f"{where}.content must not be null", param=f"{where}.content")
    check_text(content or "", f"{where}.content")
    msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.name is not None:
        msg["name"] = m.name  # for templates that render it
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": c} for c in calls] if own_template else calls
    if m.role == "tool" and m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    return msg
