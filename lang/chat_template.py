"""Role blocks of a chat template: the text before and after each role's content.

Programs build their prompt a piece at a time (`user_begin()`, text, `gen`, `user_end()`), so the model's
Jinja chat template is turned into a prefix and a suffix per role by rendering a marker as the content.
Rendered with the same sandboxed Jinja settings transformers uses, so the text matches the chat route's.
"""

from __future__ import annotations

from dataclasses import dataclass

_MARK = "\x1eRADIXLM-CONTENT\x1e"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class RoleMarkers:
    prefix: dict[str, str]
    suffix: dict[str, str]

    @classmethod
    def plain(cls) -> "RoleMarkers":
        """For models without a chat template."""
        return cls({r: f"{r.capitalize()}: " for r in ROLES}, {r: "\n" for r in ROLES})


def render(template: str, messages: list[dict], add_generation_prompt: bool = False, **special) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)


def role_markers(template: str | None, **special) -> RoleMarkers:
    """Split each role's rendering around a marker content. A template that injects a default system turn
    when none is given is rendered after an explicit system turn, whose text is then cut off."""
    if not template:
        return RoleMarkers.plain()
    prefix, suffix = {}, {}
    base = render(template, [{"role": "system", "content": "x"}], **special)
    for role in ROLES:
        if role == "system":
            full = render(template, [{"role": "system", "content": _MARK}], **special)
        else:
            full = render(template, [{"role": "system", "content": "x"}, {"role": role, "content": _MARK}], **special)
            if not full.startswith(base):  # a template that renders earlier turns differently: no system
                full = render(template, [{"role": role, "content": _MARK}], **special)
            else:
                full = full[len(base) :]
        before, _, after = full.partition(_MARK)
        prefix[role], suffix[role] = before, after
    return RoleMarkers(prefix, suffix)
