# Structured extraction: fields pulled out of free text with a JSON schema, and with a regex, then parsed.
import argparse
import json
import re
import sys

import radixlm as sgl

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Garcia is 34 years old and lives in Madrid, where she runs a small bakery.",
    "The letter was signed by Tom Becker, a 58-year-old teacher from Berlin.",
]

# A regex can spell out the exact shape of the output, JSON included.
INVOICE_REGEX = r'\{"invoice": \d+, "date": "\d{4}-\d{2}-\d{2}", "total": \d+\.\d{2}\}'
INVOICE = "Invoice number 1042 was issued on 2024-03-15. The total due is 249.99 EUR."


@sgl.function
def extract_person(s, text):
    s += sgl.system("You extract facts from text as JSON.")
    s += sgl.user(f"Text: {text}\nGive the person's name, age and city as JSON.")
    s += sgl.assistant(sgl.gen("json", max_tokens=64, temperature=0, json_schema=json.dumps(PERSON_SCHEMA)))


@sgl.function
def extract_invoice(s, text):
    s += sgl.system("You extract facts from text as JSON.")
    s += sgl.user(f"Text: {text}\nGive the invoice number, date and total as JSON.")
    s += sgl.assistant(sgl.gen("json", max_tokens=64, temperature=0, regex=INVOICE_REGEX))


def check_person(obj) -> bool:
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "age", "city"}
        and isinstance(obj["name"], str)
        and isinstance(obj["age"], int)
        and isinstance(obj["city"], str)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="JSON-schema and regex constrained extraction.")
    parser.add_argument("--url", help="use a running server instead of an in-process Engine")
    args = parser.parse_args()

    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.EngineBackend(log_level="warning")
    sgl.set_default_backend(backend)
    try:
        people = extract_person.run_batch([{"text": t} for t in TEXTS])  # both run concurrently
        invoice = extract_invoice.run(text=INVOICE)
        for st in people:
            if st.error is not None:
                raise st.error
        raw_people = [st["json"] for st in people]
        raw_invoice = invoice["json"]
    finally:
        backend.shutdown()

    ok = True
    parsed_people = []
    for text, raw in zip(TEXTS, raw_people):
        print(f"text:   {text}\nraw:    {raw}")
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            print(f"NOT JSON: {e}")
            ok, obj = False, None
        ok = ok and check_person(obj)
        parsed_people.append(obj)
        print(f"parsed: {obj!r}\n")

    print(f"text:   {INVOICE}\nraw:    {raw_invoice}")
    matches = re.fullmatch(INVOICE_REGEX, raw_invoice) is not None
    try:
        parsed_invoice = json.loads(raw_invoice)
    except json.JSONDecodeError as e:
        print(f"NOT JSON: {e}")
        parsed_invoice = None
    print(f"parsed: {parsed_invoice!r} (matches the regex: {matches})")
    ok = ok and matches and parsed_invoice is not None

    print(
        "RESULT "
        + json.dumps(
            {
                "ok": ok,
                "schema": PERSON_SCHEMA,
                "texts": TEXTS,
                "people_raw": raw_people,
                "people": parsed_people,
                "invoice_regex": INVOICE_REGEX,
                "invoice_text": INVOICE,
                "invoice_raw": raw_invoice,
                "invoice": parsed_invoice,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
