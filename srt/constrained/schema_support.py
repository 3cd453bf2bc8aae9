"""Which JSON-schema keywords each grammar backend really enforces.

Both engines drop some keywords without a word (uniqueItems, not, if/then/else, ...), and outlines-core also
drops numeric bounds; a request using one would get an answer that looks constrained and is not. We reject
those up front with a 400 naming the keyword. The table comes from probing outlines-core 0.2.14 and xgrammar
0.2.8 with valid and invalid instances of every keyword (see tests/constrained/test_json_schema_corpus.py).
Over-restrictive behaviour (declared property order, no extra keys beside `properties`) is accepted: outputs
still validate."""

from __future__ import annotations

# keyword -> why, for keywords neither engine enforces
_IGNORED_BY_BOTH = {
    "uniqueItems": "item uniqueness is not enforced by grammar engines",
    "contains": "'contains' is not enforced by grammar engines",
    "minContains": "'minContains' is not enforced by grammar engines",
    "maxContains": "'maxContains' is not enforced by grammar engines",
    "not": "negated schemas are not enforced by grammar engines",
    "if": "conditional schemas are not enforced by grammar engines",
    "then": "conditional schemas are not enforced by grammar engines",
    "else": "conditional schemas are not enforced by grammar engines",
    "dependentRequired": "dependencies between properties are not enforced by grammar engines",
    "dependentSchemas": "dependencies between properties are not enforced by grammar engines",
    "dependencies": "dependencies between properties are not enforced by grammar engines",
    "patternProperties": "property names matched by pattern are not supported",
}
_IGNORED_BY_OUTLINES = {
    "minimum": "numeric bounds are not enforced by outlines",
    "maximum": "numeric bounds are not enforced by outlines",
    "exclusiveMinimum": "numeric bounds are not enforced by outlines",
    "exclusiveMaximum": "numeric bounds are not enforced by outlines",
    "multipleOf": "multipleOf is not enforced by outlines",
    "propertyNames": "propertyNames is not enforced by outlines",
    "minProperties": "property counts are not enforced by outlines",
    "maxProperties": "property counts are not enforced by outlines",
}
_IGNORED_BY_XGRAMMAR = {
    "minProperties": "property counts are not supported together with strict objects",
    "maxProperties": "property counts are not supported together with strict objects",
}
_OUTLINES_FORMATS = {"date", "date-time", "time", "email", "uuid", "uri"}
_FIXED_LENGTH_FORMATS = {"uuid": 36, "date": 10}
_REF_SIBLINGS_OK = {
    "$ref",
    "title",
    "description",
    "$comment",
    "default",
    "examples",
    "$defs",
    "definitions",
    "$schema",
    "$id",
}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_INT64 = 2**63
# The formats JSON Schema (2020-12) defines. Any other `format` is an annotation: validators ignore it, so it is
# dropped before a backend sees it (llguidance refuses formats it does not know, outlines too).
DEFINED_FORMATS = {
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
}
# Keywords that constrain or apply subschemas (2020-12 and the older drafts' `dependencies`, tuple `items`):
# anything else beside a $ref is an annotation ($comment, title, x-..., a tool's own metadata) and is harmless.
_ASSERTIONS = {
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxContains",
    "minContains",
    "maxProperties",
    "minProperties",
    "required",
    "dependentRequired",
    "format",
    "properties",
    "patternProperties",
    "additionalProperties",
    "propertyNames",
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependencies",
    "unevaluatedItems",
    "unevaluatedProperties",
    "$ref",
    "$dynamicRef",
}


def map_schemas(schema, fn):
    """A copy of `schema` with `fn(node) -> node` applied to every schema object in it (subschemas first); values
    (enum, const, default, examples, property names) are left alone."""
    if isinstance(schema, list):
        return [map_schemas(x, fn) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: map_schemas(sub, fn) for name, sub in value.items()}
        elif key in _SUBSCHEMA_LISTS or key in _SUBSCHEMA_ONE:
            out[key] = map_schemas(value, fn)
        else:
            out[key] = value
    return fn(out)


def drop_unknown_formats(schema):
    """A copy of `schema` without `format`s that JSON Schema does not define (annotations by the spec)."""

    def drop(node: dict) -> dict:
        fmt = node.get("format")
        return (
            {k: v for k, v in node.items() if k != "format"}
            if isinstance(fmt, str) and fmt not in DEFINED_FORMATS
            else node
        )

    return map_schemas(schema, drop)


def anchor_patterns(schema):
    """A copy of `schema` whose string `pattern`s must match the whole string. JSON Schema's patterns match
    anywhere in it, so `[0-9]{5}` admits any text holding five digits, which a model may fill to its token
    limit; xgrammar and outlines anchor patterns, and what an anchored pattern admits still validates."""

    def anchor(node: dict) -> dict:
        p = node.get("pattern")
        return {**node, "pattern": f"^(?:{p})$"} if isinstance(p, str) else node

    return map_schemas(schema, anchor)


def unsupported_keyword(schema, backend: str) -> tuple[str, str, str] | None:
    """(JSON pointer, keyword, why) of the first keyword `backend` would not enforce, else None."""
    return _walk(schema, "#", backend, is_property=False)


def _walk(s, path: str, backend: str, is_property: bool):
    if isinstance(s, bool):
        if s is True and backend == "outlines" and path != "#":
            return path, "true", "the schema `true` (any value) is not supported by outlines; use {} with a type"
        return None
    if not isinstance(s, dict):
        return None
    found = _check_node(s, path, backend, is_property)
    if found:
        return found
    for key in _SUBSCHEMA_MAPS:
        sub = s.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                r = _walk(child, f"{path}/{key}/{name}", backend, is_property=key == "properties")
                if r:
                    return r
    for key in _SUBSCHEMA_LISTS:
        sub = s.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                r = _walk(child, f"{path}/{key}/{i}", backend, is_property=False)
                if r:
                    return r
    for key in _SUBSCHEMA_ONE:
        if isinstance(s.get(key), (dict, bool)):
            r = _walk(s[key], f"{path}/{key}", backend, is_property=False)
            if r:
                return r
    return None


def _check_node(s: dict, path: str, backend: str, is_property: bool):
    for kw, why in _IGNORED_BY_BOTH.items():
        if kw in s and not (kw == "uniqueItems" and s[kw] is False):
            return path, kw, why
    table = _IGNORED_BY_OUTLINES if backend == "outlines" else _IGNORED_BY_XGRAMMAR
    for kw, why in table.items():
        if kw in s:
            return path, kw, why
    if "$ref" in s and (set(s) & _ASSERTIONS) - _REF_SIBLINGS_OK:
        extra = sorted((set(s) & _ASSERTIONS) - _REF_SIBLINGS_OK)[0]
        return path, extra, "keywords beside $ref are ignored by grammar engines; move them into the referenced schema"
    if isinstance(s.get("items"), list):
        return path, "items", "tuple form (an array of schemas) is not supported; use prefixItems"
    if "pattern" in s and ("minLength" in s or "maxLength" in s):
        kw = "minLength" if "minLength" in s else "maxLength"
        return path, kw, "a length bound together with a pattern is not enforced; put the length into the pattern"
    if isinstance(s.get("allOf"), list) and (len(s["allOf"]) > 1 or backend == "outlines"):
        return path, "allOf", "schema intersections are not enforced by grammar engines; merge the branches"
    if isinstance(s.get("oneOf"), list) and not _disjoint(s["oneOf"]):
        return (
            path,
            "oneOf",
            "branches that may overlap are enforced as anyOf; give each branch a distinct type or const",
        )
    fmt = s.get("format")
    if isinstance(fmt, str) and ("minLength" in s or "maxLength" in s):
        # outlines keeps the length and drops the format; xgrammar keeps the format and drops the length, which
        # is harmless only when every string of the format has a length within the bounds
        n = _FIXED_LENGTH_FORMATS.get(fmt)
        if backend == "outlines" or n is None or not s.get("minLength", 0) <= n <= s.get("maxLength", n):
            kw = "minLength" if "minLength" in s else "maxLength"
            return (
                path,
                kw,
                (
                    "a length bound together with a format is not enforced (one of the two is dropped); "
                    "drop the bound or write the format as a pattern"
                ),
            )
    if backend == "outlines" and isinstance(fmt, str) and fmt not in _OUTLINES_FORMATS:
        return path, "format", f"format {fmt!r} is not supported by outlines (it knows {sorted(_OUTLINES_FORMATS)})"
    if (
        backend == "outlines"
        and is_property
        and not (set(s) - {"title", "description", "$comment", "default", "examples"})
    ):
        return path, "{}", "a property with no type (any value) is not supported by outlines; give it a type"
    if backend == "xgrammar":
        if "multipleOf" in s and s.get("type") != "integer":
            return path, "multipleOf", "multipleOf is enforced on integers only"
        for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = s.get(kw)
            if s.get("type") == "integer" and isinstance(v, (int, float)) and abs(v) >= _INT64:
                return path, kw, "integer bounds beyond 64 bits are not supported"
    return None


def _disjoint(branches: list) -> bool:
    """Provably non-overlapping: each branch a different JSON type, or a different const / enum values on one
    shared discriminating property."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if (
        all(isinstance(t, str) for t in types)
        and len(set(types)) == len(types)
        and not {"integer", "number"} <= set(types)
    ):
        return True
    consts = [b.get("const", _NO) if isinstance(b, dict) else _NO for b in branches]
    if all(c is not _NO for c in consts):
        return len({repr(c) for c in consts}) == len(consts)
    return _discriminated(branches)


_NO = object()


def _discriminated(branches: list) -> bool:
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    shared = set.intersection(*[set(b["properties"]) & set(b.get("required", [])) for b in branches])
    for key in shared:
        seen: set[str] = set()
        ok = True
        for b in branches:
            p = b["properties"][key]
            vals = (
                [p["const"]]
                if isinstance(p, dict) and "const" in p
                else (p.get("enum") if isinstance(p, dict) and isinstance(p.get("enum"), list) else None)
            )
            if vals is None or any(repr(v) in seen for v in vals):
                ok = False
                break
            seen.update(repr(v) for v in vals)
        if ok:
            return True
    return False
