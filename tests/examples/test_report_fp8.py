"""benchmarks/report_fp8.py reads a run_fp8.sh folder as it comes back from the GPU machine: every variant's
ratio to the bf16 row of the same shape and batch, and radixlm's output to vLLM's at the same users."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report_fp8

RUN = Path(__file__).parents[2] / "benchmarks/results/h200/fp8/fused_norm"


def test_ratios_follow_the_json():
    rows = report_fp8.with_ratios(report_fp8.decode_rows(RUN))
    fp8 = json.loads((RUN / "decode8b_fp8_head.json").read_text())["rows"]
    bf16 = json.loads((RUN / "decode8b_bf16.json").read_text())["rows"]
    for want_fp8, want_bf16 in zip(fp8, bf16):
        got = next(r for r in rows if (r["shape"], r["variant"], r["batch"]) == ("8b", "fp8_head", want_fp8["batch"]))
        assert abs(got["vs_bf16"] - want_fp8["tokens_per_s"] / want_bf16["tokens_per_s"]) < 1e-9
    # the 70B rows have no bf16 row of their shape: no ratio, not a ratio against the 8B
    assert all(r["vs_bf16"] is None for r in rows if r["shape"] == "70b")
    serve = {(r["engine"], r["users"]): r for r in report_fp8.serving_rows(RUN)}
    assert set(serve) == {("radixlm", 64), ("vLLM", 64), ("radixlm", 256), ("vLLM", 256)}
    peer = json.loads((RUN / "vllm70b_fp8_1000_1000_c256.json").read_text())
    assert serve[("vLLM", 256)]["output"] == peer["output_throughput"]
    assert report_fp8.plain_graph(RUN)[1] > 0
