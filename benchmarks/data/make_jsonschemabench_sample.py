"""Rebuild benchmarks/data/jsonschemabench_sample.jsonl from a local checkout of the JSONSchemaBench corpus.

    python benchmarks/data/make_jsonschemabench_sample.py /path/to/jsonschemabench-checkout [--out FILE]

The checkout is https://github.com/guidance-ai/jsonschemabench (the schemas live in data/<subset>/<id>.json).
Rule, per subset: ids are the file names under data/<subset>/ minus the ".json" suffix; sort them (Python str
order), draw random.Random(20261125).sample(ids, 40) (all ids if fewer than 40), load each drawn file and keep
it only if it parses as a JSON object. Lines are ordered by subset, then id; each line is
{"subset": ..., "id": ..., "schema": ...} with the schema's key order as in the file. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SEED = 20261125
PER_SUBSET = 40
SUBSETS = [
    "Github_easy",
    "Github_hard",
    "Github_medium",
    "Github_trivial",
    "Github_ultra",
    "Glaiveai2K",
    "JsonSchemaStore",
    "Kubernetes",
    "Snowplow",
    "WashingtonPost",
]
DEFAULT_OUT = Path(__file__).resolve().parent / "jsonschemabench_sample.jsonl"


def sample_ids(ids: list[str]) -> list[str]:
    ids = sorted(ids)
    if len(ids) <= PER_SUBSET:
        return ids
    return random.Random(SEED).sample(ids, PER_SUBSET)


def build(checkout: Path) -> tuple[list[dict], list[str]]:
    rows, notes = [], []
    for subset in sorted(SUBSETS):
        folder = checkout / "data" / subset
        if not folder.is_dir():
            raise SystemExit(f"missing folder {folder}")
        ids = [p.name[: -len(".json")] for p in folder.iterdir() if p.is_file() and p.name.endswith(".json")]
        kept = 0
        for id_ in sorted(sample_ids(ids)):
            try:
                schema = json.loads((folder / f"{id_}.json").read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                notes.append(f"{subset}/{id_}: dropped, not JSON ({e})")
                continue
            if not isinstance(schema, dict):
                notes.append(f"{subset}/{id_}: dropped, a JSON {type(schema).__name__}, not an object")
                continue
            rows.append({"subset": subset, "id": id_, "schema": schema})
            kept += 1
        notes.append(f"{subset}: {len(ids)} ids, kept {kept}")
    return rows, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path, help="local checkout of github.com/guidance-ai/jsonschemabench")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    rows, notes = build(args.checkout)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    for n in notes:
        print(n, file=sys.stderr)
    print(f"wrote {len(rows)} schemas to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
