"""The default backend (`auto`) on 400 real-world schemas nobody here wrote (a seeded sample of JSONSchemaBench,
benchmarks/data): it accepts at least 80% at the edge, and every schema the edge accepts compiles, with the
backend the edge chose, well inside the compile time limit. A schema a backend cannot compile must be refused
at the edge with a 400, never accepted and then failed (or timed out) in the scheduler.

benchmarks/bench_schema_coverage.py measures the same sample per backend, with timings and generation."""

from __future__ import annotations

from benchmarks.bench_schema_coverage import load
from radixlm.srt.constrained.manager import create_backend
from radixlm.srt.constrained.spec import check_supported, grammar_spec
from radixlm.srt.errors import GrammarError
from tests.helpers import smollm_tokenizer


def test_auto_accepts_most_real_schemas_and_compiles_all_it_accepts():
    items = load()
    assert len(items) == 400 and len({it["subset"] for it in items}) == 10
    tok = smollm_tokenizer()
    backend = create_backend("auto", tok, len(tok), [tok.eos_token_id])
    accepted, failed = 0, []
    for it in items:
        try:
            spec = grammar_spec(json_schema=it["schema"])
            chosen = check_supported(spec, "auto")
        except GrammarError:
            continue
        accepted += 1
        try:
            backend.backend(chosen).compile(spec).matcher()
        except Exception as e:  # noqa: BLE001 - any failure after the edge accepted is the bug looked for
            failed.append(f"{it['subset']}/{it['id']} ({chosen}): {type(e).__name__}: {str(e)[:200]}")
    assert not failed, "\n".join(failed)
    assert accepted >= 320, accepted  # 80% of the sample
