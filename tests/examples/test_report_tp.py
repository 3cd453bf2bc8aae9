"""benchmarks/report_tp.py reads a run_tp.sh / run_tp_x4.sh folder as it comes back from the GPU machine: decode
rows per tp size, and each radixlm serving row's output tok/s over vLLM's at the same tp and workload."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report_tp

RUN = Path(__file__).parents[2] / "benchmarks/results/h200x4/tp/s13"


def test_peer_ratio_pairs_tp_and_workload():
    rows = {(r["engine"], r["tp"], r["workload"]): r for r in report_tp.serving_rows(RUN)}
    assert {(tp, w) for _, tp, w in rows} == {(2, "512_256"), (2, "1000_1000"), (4, "512_256"), (4, "1000_1000")}
    for (engine, tp, w), r in rows.items():
        if engine == "vLLM":
            assert r["vs_vllm"] is None
            continue
        ours = json.loads((RUN / f"llama70b_fp8_kv8_tp{tp}_{w}.json").read_text())["output_throughput"]
        peer = json.loads((RUN / f"vllm70b_fp8_tp{tp}_{w}.json").read_text())["output_throughput"]
        assert abs(r["vs_vllm"] - ours / peer) < 1e-12


def test_a_row_without_its_peer_has_no_ratio():
    rows = report_tp.with_peer_ratio(
        [
            {"engine": "radixlm", "tp": 2, "workload": "512_256", "output": 10.0},
            {"engine": "vLLM", "tp": 4, "workload": "512_256", "output": 5.0},
        ]
    )
    assert [r["vs_vllm"] for r in rows] == [None, None]


def test_decode_rows_per_tp():
    rows = report_tp.decode_rows(RUN)
    assert {(r["tp"], r["batch"]) for r in rows} == {(tp, b) for tp in (1, 2) for b in (1, 32, 128)}
    assert all(r["pipelined_step_ms"] > 0 for r in rows)
