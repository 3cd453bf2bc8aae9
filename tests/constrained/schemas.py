"""A corpus of small JSON schemas of real-world shapes, each with a name and a one-line description for the prompt.

Every free-form string carries a `maxLength` (or a pattern / format / enum of bounded length) and every array a
`maxItems`, so that the small test model's constrained answer ends well inside a few hundred tokens.

`rejects` names the keywords of a schema that no grammar engine can enforce (uniqueness, negation, conditionals,
dependencies, pattern-matched property names, ...): every backend must answer such a schema with a 400 naming
one of them. Other schemas may still be refused by one backend (outlines does not enforce numeric bounds, for
example); the tests ask the backend which ones and check that the refusal names a keyword the schema really
uses, and that each backend still accepts most of the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    schema: dict
    rejects: tuple[str, ...] = field(default=())


def _s(max_length: int = 24, min_length: int | None = None) -> dict:
    d = {"type": "string", "maxLength": max_length}
    if min_length is not None:
        d["minLength"] = min_length
    return d


def _obj(properties: dict, required=None, strict: bool = True, **extra) -> dict:
    d = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else list(required),
    }
    if strict:
        d["additionalProperties"] = False
    d.update(extra)
    return d


EMAIL = {"type": "string", "format": "email"}
DATE = {"type": "string", "format": "date"}
DATE_TIME = {"type": "string", "format": "date-time"}
UUID = {"type": "string", "format": "uuid"}

CASES: list[Case] = [
    # --- flat records ----------------------------------------------------------------------------------------
    Case(
        "user_profile",
        "a user account (email like ann@mail.com)",
        _obj({"id": {"type": "integer"}, "username": _s(16, 3), "email": EMAIL, "active": {"type": "boolean"}}),
    ),
    Case(
        "postal_address",
        "a postal address in North America",
        _obj(
            {
                "street": _s(20),
                "city": _s(20),
                "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["US", "CA", "MX"]},
            },
            required=["street", "city", "country"],
        ),
    ),
    Case(
        "product",
        "a product in a shop catalogue",
        _obj(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "name": _s(20),
                "price": {"type": "number"},
                "tags": {"type": "array", "items": _s(10), "maxItems": 3},
            },
            required=["sku", "name", "price"],
        ),
    ),
    Case(
        "geo_point",
        "a point on a map",
        _obj({"lat": {"type": "number"}, "lon": {"type": "number"}, "label": _s(20)}, required=["lat", "lon"]),
    ),
    Case(
        "feature_toggles",
        "the feature switches of an app",
        _obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"}, "telemetry": {"type": "boolean"}}),
    ),
    Case(
        "weather_report",
        "today's weather in a city",
        _obj(
            {
                "city": _s(20),
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]},
                "temperature_c": {"type": "number"},
                "humidity_pct": {"type": "integer"},
            }
        ),
    ),
    Case(
        "pagination",
        "a page of search results",
        _obj(
            {
                "page": {"type": "integer"},
                "per_page": {"type": "integer"},
                "total": {"type": "integer"},
                "has_next": {"type": "boolean"},
            }
        ),
    ),
    Case(
        "chat_message",
        "one message in a chat",
        _obj({"role": {"type": "string", "enum": ["system", "user", "assistant"]}, "content": _s(20, 1)}),
    ),
    Case(
        "contact_phone",
        "a contact with a phone number",
        _obj({"name": _s(24, 1), "phone": {"type": "string", "pattern": "^\\+[0-9]{10,12}$"}}),
    ),
    Case(
        "package_version",
        "a software package and its version",
        _obj(
            {
                "package": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,19}$"},
                "version": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"},
            }
        ),
    ),
    Case(
        "optional_settings",
        "optional display settings (any subset may be given)",
        _obj(
            {
                "theme": {"enum": ["light", "dark"]},
                "font_size": {"type": "integer"},
                "language": {"type": "string", "pattern": "^[a-z]{2}$"},
                "compact": {"type": "boolean"},
            },
            required=[],
        ),
    ),
    Case(
        "loose_record",
        "a record that may carry extra fields",
        _obj({"id": {"type": "integer"}, "title": _s(20)}, strict=False),
    ),
    # --- const / enum -------------------------------------------------------------------------------------------
    Case(
        "config_header",
        "the header of a configuration file",
        _obj({"kind": {"const": "Config"}, "apiVersion": {"const": "v1"}, "name": _s(20, 1)}),
    ),
    Case("traffic_light", "the colour of a traffic light", {"enum": ["red", "amber", "green"]}),
    Case("http_status", "an HTTP status", _obj({"code": {"enum": [200, 201, 400, 404, 500]}, "reason": _s(24)})),
    Case(
        "api_success",
        "a successful API reply",
        _obj(
            {
                "status": {"const": "ok"},
                "data": _obj(
                    {
                        "count": {"type": "integer"},
                        "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                    }
                ),
            }
        ),
    ),
    Case(
        "api_error",
        "an API error reply",
        _obj(
            {
                "error": _obj(
                    {"code": {"type": "string", "enum": ["not_found", "forbidden", "invalid"]}, "message": _s(24)}
                )
            }
        ),
    ),
    Case(
        "task_item",
        "a to-do item (due date like 2024-05-01)",
        _obj(
            {"title": _s(20, 1), "done": {"type": "boolean"}, "priority": {"enum": [1, 2, 3]}, "due": DATE},
            required=["title", "done", "priority"],
        ),
    ),
    # --- formats -------------------------------------------------------------------------------------------------
    Case(
        "calendar_event",
        "a calendar event (day like 2024-05-01, starts_at like 2024-05-01T09:30:00Z)",
        _obj({"title": _s(20, 1), "day": DATE, "starts_at": DATE_TIME}),
    ),
    Case(
        "log_entry",
        "a line of a server log (timestamp like 2024-05-01T09:30:00Z)",
        _obj({"level": {"enum": ["debug", "info", "warning", "error"]}, "message": _s(24), "timestamp": DATE_TIME}),
    ),
    Case("uuid_list", "a list of record identifiers", {"type": "array", "items": UUID, "minItems": 1, "maxItems": 2}),
    Case(
        "bank_transaction",
        "a bank transaction (booked_at like 2024-05-01T09:30:00Z)",
        _obj(
            {
                "amount": {"type": "number"},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "booked_at": DATE_TIME,
            }
        ),
    ),
    Case(
        "newsletter_signup",
        "a newsletter sign-up (email like bob@mail.com, date like 2024-05-01)",
        _obj(
            {
                "email": EMAIL,
                "subscribed_on": DATE,
                "topics": {"type": "array", "items": {"enum": ["tech", "sports", "music"]}, "maxItems": 3},
            }
        ),
    ),
    Case("date_range", "a date range (dates like 2024-05-01)", _obj({"start": DATE, "end": DATE})),
    Case(
        "record_ref",
        "a reference to a database row (the id column is a 36-character UUID)",
        _obj({"table": _s(12, 1), "id": {**UUID, "maxLength": 36}}),
    ),
    Case(
        "audit_event",
        "an audit trail event (actor email like eve@corp.com, at like 2024-05-01T09:30:00Z)",
        _obj({"event_id": UUID, "actor": EMAIL, "action": {"enum": ["create", "update", "delete"]}, "at": DATE_TIME}),
    ),
    # --- arrays --------------------------------------------------------------------------------------------------
    Case(
        "book",
        "a book",
        _obj(
            {
                "title": _s(20, 1),
                "authors": {"type": "array", "items": _s(24, 1), "minItems": 1, "maxItems": 3},
                "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
                "year": {"type": "integer"},
            }
        ),
    ),
    Case(
        "rgb_triplet",
        "a colour as three channel values",
        {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
    ),
    Case(
        "polyline",
        "a line through two to four points",
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 4,
            "items": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        },
    ),
    Case(
        "small_matrix",
        "a small matrix of integers",
        {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        },
    ),
    Case(
        "permissions",
        "the permissions of a user role",
        _obj(
            {
                "role": _s(16, 1),
                "grants": {
                    "type": "array",
                    "items": {"enum": ["read", "write", "admin"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
    ),
    Case(
        "sensor_reading",
        "a batch of sensor readings",
        _obj(
            {
                "sensor_id": {"type": "string", "pattern": "^S-[0-9]{3}$"},
                "values": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
                "unit": {"const": "celsius"},
            }
        ),
    ),
    Case(
        "name_pair",
        "a first and last name",
        {"type": "array", "prefixItems": [_s(16, 1), _s(16, 1)], "items": False, "minItems": 2},
    ),
    Case(
        "recipe",
        "a recipe",
        _obj(
            {
                "name": _s(20, 1),
                "servings": {"type": "integer"},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj({"item": _s(20, 1), "amount": _s(12)}),
                },
                "steps": {"type": "array", "items": _s(20, 1), "minItems": 1, "maxItems": 3},
            }
        ),
    ),
    # --- nesting ----------------------------------------------------------------------------------------------------
    Case(
        "order",
        "a web shop order",
        _obj(
            {
                "order_id": UUID,
                "customer": _obj({"name": _s(16, 1), "vip": {"type": "boolean"}}),
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _obj(
                        {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "quantity": {"type": "integer"}}
                    ),
                },
                "status": {"enum": ["pending", "paid", "shipped"]},
            }
        ),
    ),
    Case(
        "company",
        "a company and its chief executive",
        _obj(
            {
                "name": _s(20, 1),
                "ceo": _obj(
                    {
                        "name": _s(24, 1),
                        "contact": _obj(
                            {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}, "office": _s(12, 1)}
                        ),
                    }
                ),
            }
        ),
    ),
    Case(
        "http_request",
        "an HTTP request",
        _obj(
            {
                "method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                "path": {"type": "string", "pattern": "^/[a-z/]{1,20}$"},
                "headers": {"type": "array", "maxItems": 2, "items": _obj({"name": _s(16, 1), "value": _s(24)})},
            }
        ),
    ),
    Case(
        "tool_call",
        "a call of the get_weather function",
        _obj(
            {
                "name": {"const": "get_weather"},
                "arguments": _obj({"location": _s(24, 1), "unit": {"enum": ["celsius", "fahrenheit"]}}),
            }
        ),
    ),
    # --- $defs / $ref ---------------------------------------------------------------------------------------------
    Case(
        "person_with_addresses",
        "a person with a home and a work address",
        {
            "$defs": {"address": _obj({"street": _s(24), "city": _s(20)})},
            **_obj(
                {"name": _s(24, 1), "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
                required=["name", "home"],
            ),
        },
    ),
    Case(
        "invoice",
        "an invoice (due date like 2024-05-01)",
        {
            "$defs": {
                "money": _obj({"amount": {"type": "number"}, "currency": {"enum": ["EUR", "USD", "GBP"]}}),
                "line": _obj({"text": _s(24, 1), "price": {"$ref": "#/$defs/money"}}),
            },
            **_obj(
                {
                    "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                    "due": DATE,
                    "paid": {"type": "boolean"},
                    "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 1},
                }
            ),
        },
    ),
    Case(
        "employee",
        "an employee and their manager, if any",
        {
            "$defs": {"person": _obj({"name": _s(16, 1), "title": _s(16, 1)})},
            **_obj(
                {
                    "self": {"$ref": "#/$defs/person"},
                    "manager": {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]},
                    "department": {"enum": ["sales", "engineering", "support"]},
                }
            ),
        },
    ),
    # --- anyOf / oneOf ----------------------------------------------------------------------------------------------
    Case(
        "nullable_nickname",
        "a user who may have a nickname",
        _obj({"name": _s(24, 1), "nickname": {"anyOf": [_s(16, 1), {"type": "null"}]}}),
    ),
    Case(
        "shape",
        "a geometric shape",
        {
            "anyOf": [
                _obj({"kind": {"const": "circle"}, "radius": {"type": "number"}}),
                _obj({"kind": {"const": "rectangle"}, "width": {"type": "number"}, "height": {"type": "number"}}),
            ]
        },
    ),
    Case(
        "payment_method",
        "how an order was paid (card, or paypal with an email like joe@mail.com)",
        {
            "oneOf": [
                _obj({"method": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                _obj({"method": {"const": "paypal"}, "email": EMAIL}),
            ]
        },
    ),
    Case(
        "survey_answer",
        "an answer to a survey question",
        _obj(
            {
                "question_id": {"type": "integer"},
                "answer": {"anyOf": [{"type": "boolean"}, {"type": "integer"}, _s(20, 1)]},
            }
        ),
    ),
    Case(
        "movie",
        "a movie",
        _obj(
            {
                "title": _s(20, 1),
                "year": {"type": "integer"},
                "genres": {
                    "type": "array",
                    "items": {"enum": ["drama", "comedy", "action", "horror"]},
                    "minItems": 1,
                    "maxItems": 2,
                },
                "rating": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            }
        ),
    ),
    # --- keywords that outlines does not enforce (numeric bounds, allOf, multipleOf, formats it lacks) -----------
    Case(
        "star_rating",
        "a star rating of a product",
        _obj({"product": _s(24, 1), "stars": {"type": "integer", "minimum": 1, "maximum": 5}}),
    ),
    Case(
        "progress",
        "the progress of a download",
        _obj({"file": _s(24, 1), "percent": {"type": "number", "minimum": 0, "maximum": 100}}),
    ),
    Case(
        "outdoor_temperature",
        "an outdoor temperature reading",
        _obj({"station": _s(16, 1), "celsius": {"type": "number", "exclusiveMinimum": -60, "exclusiveMaximum": 60}}),
    ),
    Case(
        "person_age",
        "a person's age",
        _obj({"name": _s(24, 1), "age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 150}}),
    ),
    Case(
        "rgb_color",
        "a colour in RGB",
        _obj(
            {
                "r": {"type": "integer", "minimum": 0, "maximum": 255},
                "g": {"type": "integer", "minimum": 0, "maximum": 255},
                "b": {"type": "integer", "minimum": 0, "maximum": 255},
            }
        ),
    ),
    Case(
        "even_batch",
        "a batch size (an even number)",
        _obj({"batch_size": {"type": "integer", "multipleOf": 2, "minimum": 2, "maximum": 64}}),
    ),
    Case("single_allof", "a labelled item", {"allOf": [_obj({"label": _s(20, 1), "count": {"type": "integer"}})]}),
    Case(
        "server_address",
        "a server's IPv4 address",
        _obj({"host": _s(20, 1), "ip": {"type": "string", "format": "ipv4"}}),
    ),
    # --- keywords no grammar engine enforces: a 400 everywhere ---------------------------------------------------
    Case(
        "unique_tags",
        "a post with distinct tags",
        _obj({"tags": {"type": "array", "items": _s(10, 1), "maxItems": 3, "uniqueItems": True}}),
        rejects=("uniqueItems",),
    ),
    Case("not_null", "a value that is anything but null", _obj({"value": {"not": {"type": "null"}}}), rejects=("not",)),
    Case(
        "conditional_shipping",
        "shipping details that depend on the country",
        {
            **_obj({"country": {"enum": ["US", "CA"]}, "postal_code": _s(10, 1)}),
            "if": {"properties": {"country": {"const": "US"}}},
            "then": {"properties": {"postal_code": {"pattern": "^[0-9]{5}$"}}},
            "else": {"properties": {"postal_code": {"pattern": "^[A-Z][0-9][A-Z] [0-9][A-Z][0-9]$"}}},
        },
        rejects=("if", "then", "else"),
    ),
    Case(
        "env_vars",
        "environment variables",
        {"type": "object", "patternProperties": {"^[A-Z_]+$": _s(20)}, "additionalProperties": False},
        rejects=("patternProperties",),
    ),
    Case(
        "billing",
        "a credit card with its billing address",
        {
            **_obj({"name": _s(20, 1), "credit_card": _s(19, 1), "billing_address": _s(20, 1)}, required=["name"]),
            "dependentRequired": {"credit_card": ["billing_address"]},
        },
        rejects=("dependentRequired",),
    ),
    Case(
        "has_admin",
        "a member list that contains an admin",
        _obj(
            {
                "members": {
                    "type": "array",
                    "maxItems": 3,
                    "contains": _obj({"admin": {"const": True}}),
                    "items": _obj({"name": _s(16, 1), "admin": {"type": "boolean"}}),
                }
            }
        ),
        rejects=("contains",),
    ),
    Case(
        "dependent_schema",
        "a payment with conditional card fields",
        {
            **_obj({"name": _s(20, 1), "card": _s(19, 1)}, required=["name"]),
            "dependentSchemas": {"card": {"required": ["cvv"], "properties": {"cvv": {"type": "string"}}}},
        },
        rejects=("dependentSchemas",),
    ),
    Case(
        "sized_object",
        "an object with one to three properties",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
            "minProperties": 1,
            "maxProperties": 3,
            "additionalProperties": False,
        },
        rejects=("minProperties", "maxProperties"),
    ),
    Case(
        "bounded_pattern",
        "a short code",
        _obj({"code": {"type": "string", "pattern": "^[A-Z0-9]+$", "maxLength": 6}}),
        rejects=("maxLength",),
    ),
    Case(
        "overlapping_oneof",
        "a short or a long label (exactly one)",
        _obj({"label": {"oneOf": [{"type": "string", "maxLength": 5}, {"type": "string", "maxLength": 10}]}}),
        rejects=("oneOf",),
    ),
    Case(
        "decimal_price",
        "a price in whole cents",
        _obj({"price": {"type": "number", "multipleOf": 0.01}}),
        rejects=("multipleOf",),
    ),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"
