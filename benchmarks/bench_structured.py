"""Constrained generation with the in-process Engine: per grammar backend, JSON-schema and regex requests
against the same prompts unconstrained, and jump-forward on vs off.

For each configuration it reports wall time, output tokens/s, forward passes (decode + extend steps),
jump-forward tokens, grammar compile time (cold: first use; warm: the cache) and how many outputs are valid
(JSON Schema validation with `jsonschema` when installed, `re.fullmatch` for regexes).

    python benchmarks/bench_structured.py --out benchmarks/results/cpu-2core/structured.json
    python benchmarks/bench_structured.py --model-path DIR --num-requests 64 --backends xgrammar
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path

import radixlm

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "email", "role", "active"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "tags": {
                "type": "array",
                "items": {"enum": ["news", "sport", "tech", "art"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "published": {"type": "string", "format": "date"},
        },
        "required": ["title", "tags", "published"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"const": "shipped"},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 24},
                    "city": {"type": "string", "maxLength": 16},
                    "country": {"enum": ["FR", "DE", "US", "JP"]},
                },
                "required": ["street", "city", "country"],
                "additionalProperties": False,
            },
        },
        "required": ["order_id", "status", "address"],
        "additionalProperties": False,
    },
]
REGEXES = [
    r"\d{4}-\d{2}-\d{2}",
    r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)",
    r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(red|green|blue|yellow)",
]
PROMPTS = [
    "Give me a record as JSON.",
    "Write the data for one example entry.",
    "Answer with the details:",
    "Produce one item.",
    "Fill in the form for a customer.",
]


def _validator():
    try:
        import jsonschema

        return lambda text, schema: _valid_json(jsonschema, text, schema)
    except ImportError:  # the test extra has it; without it only JSON syntax is checked
        return lambda text, schema: _parses(text)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _valid_json(jsonschema, text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_case(engine, kind: str, n: int, temperature: float, max_new: int) -> dict:
    valid = _validator()
    prompts, params, checks = [], [], []
    for i in range(n):
        p = {"temperature": temperature, "max_new_tokens": max_new, "seed": i}
        if kind == "json":
            schema = SCHEMAS[i % len(SCHEMAS)]
            p["json_schema"] = schema
            checks.append(lambda t, s=schema: valid(t, s))
        elif kind == "regex":
            rx = REGEXES[i % len(REGEXES)]
            p["regex"] = rx
            checks.append(lambda t, r=rx: re.fullmatch(r, t) is not None)
        else:
            checks.append(lambda t: True)
        prompts.append(PROMPTS[i % len(PROMPTS)] + " ")
        params.append(p)
    before = engine.get_stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    secs = time.perf_counter() - t
    after = engine.get_stats()
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    g0, g1 = before["grammar"], after["grammar"]
    return {
        "kind": kind,
        "requests": n,
        "seconds": secs,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / secs,
        "forward_passes": (after["decode_steps"] - before["decode_steps"])
        + (after["extend_steps"] - before["extend_steps"]),
        "jump_forward_tokens": g1["jump_forward_tokens"] - g0["jump_forward_tokens"],
        "compiles": g1["compiles"] - g0["compiles"],
        "cache_hits": g1["cache_hits"] - g0["cache_hits"],
        "compile_seconds": g1["compile_seconds_sum"] - g0["compile_seconds_sum"],
        "valid": sum(check(o["text"]) for check, o in zip(checks, outs)),
        "finished_by_length": sum(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--backends", nargs="+", default=["outlines", "xgrammar"])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for backend in args.backends:
        for jf in (True, False):
            engine = radixlm.Engine(
                args.model_path, log_level="warning", grammar_backend=backend, jump_forward="on" if jf else "off"
            )
            cases = ["none", "json", "json", "regex"] if jf else ["json", "regex"]
            for i, kind in enumerate(cases):
                row = run_case(engine, kind, args.num_requests, args.temperature, args.max_new_tokens)
                row.update(
                    backend=backend,
                    jump_forward=jf,
                    cache="warm" if kind == "json" and cases[:i].count("json") else "cold",
                )
                rows.append(row)
                print(
                    f"{backend:>9} jf={jf!s:5} {kind:>5} ({row['cache']}): {row['seconds']:6.2f} s "
                    f"{row['output_tokens_per_s']:7.1f} out tok/s  {row['forward_passes']:4d} forwards  "
                    f"jf tokens {row['jump_forward_tokens']:4d}  compile {row['compile_seconds']:6.2f} s "
                    f"({row['compiles']} new)  valid {row['valid']}/{row['requests']}  "
                    f"cut by length {row['finished_by_length']}",
                    flush=True,
                )
            engine.shutdown()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {"machine": platform.node(), "processor": platform.processor(), "config": vars(args), "rows": rows},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
