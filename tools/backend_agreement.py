"""How often two grammar backends give the same greedy answer to the same JSON-schema request: the precondition
for switching a request between backends (an index backend's cheaper masks for a hot schema) without changing
what users get. Runs the test corpus (`tests/constrained/schemas.py`) on the embedded model in fp32, greedy.

Usage: python tools/backend_agreement.py [--backends llguidance outlines] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radixlm  # noqa: E402
from radixlm.srt.constrained.base import GrammarSpec  # noqa: E402
from radixlm.srt.constrained.spec import check_supported  # noqa: E402
from radixlm.srt.errors import GrammarError  # noqa: E402
from tests.constrained.schemas import CASES  # noqa: E402


def accepts(backend: str, schema: dict) -> bool:
    try:
        check_supported(GrammarSpec("json_schema", json.dumps(schema, sort_keys=True)), backend)
    except GrammarError:
        return False
    return True


def answers(backend: str, max_new_tokens: int) -> dict[str, str | None]:
    """Each corpus schema's greedy answer on this backend; None where it refuses the schema."""
    cases = [c for c in CASES if accepts(backend, c.schema)]
    e = radixlm.Engine(grammar_backend=backend, quantization="none", log_level="error", jump_forward="off")
    try:
        prompts = [f"Write {c.description} as JSON: " for c in cases]
        params = [
            {"json_schema": json.dumps(c.schema), "temperature": 0, "max_new_tokens": max_new_tokens} for c in cases
        ]
        outs = e.generate(prompts, params)
        got = {
            c.name: None if o["meta_info"]["finish_reason"]["type"] == "abort" else o["text"]
            for c, o in zip(cases, outs)
        }
        return {c.name: got.get(c.name) for c in CASES}
    finally:
        e.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs=2, default=["llguidance", "outlines"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    a, b = (answers(name, args.max_new_tokens) for name in args.backends)
    both = [n for n in a if a[n] is not None and b[n] is not None]
    same = [n for n in both if a[n] == b[n]]
    print(f"{len(CASES)} schemas, {len(both)} accepted by both, same greedy answer: {len(same)}")
    for n in both:
        if a[n] != b[n]:
            print(f"  {n}:\n    {args.backends[0]}: {a[n][:120]!r}\n    {args.backends[1]}: {b[n][:120]!r}")


if __name__ == "__main__":
    main()
