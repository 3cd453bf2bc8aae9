"""Investigation (issue 34): what the speculative gate saw and decided, step by step, during a bench_speculative
run. The benchmark's rows say how many verify steps and closures a run had; this says why (a first judgement
against no decoding figure, probes after short pauses, a noisy stretch). It runs benchmarks/bench_speculative.py
with the same arguments, records every SpecGate.observe (step, bucket, open or closed, tokens, milliseconds) and
every closure (bucket, length, pause table), and writes them beside the benchmark's JSON, with a per-row summary
on stdout: steps open and closed per bucket, closures and the pauses they set.

    python tools/gate_trace.py --trace-out gate.json -- --model-path benchmarks/configs/llama-3.1-8b \
        --workloads forced --forced-acceptance 0.7 --batch-sizes 64 128 --repeats 2 load_format=dummy ...
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from radixlm.srt.speculative import gate as G  # noqa: E402


def install(log: list) -> None:
    observe, close = G.SpecGate.observe, G.SpecGate._close

    def traced_observe(self, is_open, n, tokens, seconds):
        log.append({"ev": "step", "step": self.step, "bucket": self.bucket(n), "n": n, "open": is_open,
                    "tokens": tokens, "ms": round(seconds * 1e3, 3)})  # fmt: skip
        return observe(self, is_open, n, tokens, seconds)

    def traced_close(self, b, steps, measure=False):
        log.append({"ev": "close", "step": self.step, "bucket": b, "steps": steps, "measure": measure,
                    "pause": dict(self.pause), "lost": dict(self.lost)})  # fmt: skip
        return close(self, b, steps, measure)

    G.SpecGate.observe, G.SpecGate._close = traced_observe, traced_close


def summary(log: list) -> str:
    steps = Counter((e["bucket"], e["open"]) for e in log if e["ev"] == "step")
    closes = [e for e in log if e["ev"] == "close" and not e["measure"]]
    lines = [f"bucket {b} ({'open' if o else 'closed' if o is False else 'extend'}): {c} steps"
             for (b, o), c in sorted(steps.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]  # fmt: skip
    lines += [f"closure at step {e['step']}: bucket {e['bucket']} for {e['steps']} steps" for e in closes]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace-out", type=Path, required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_speculative.py's arguments")
    args = ap.parse_args()
    bench = [a for a in args.bench_args if a != "--"]
    log: list = []
    install(log)
    sys.argv = [str(ROOT / "benchmarks" / "bench_speculative.py"), *bench]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        args.trace_out.parent.mkdir(parents=True, exist_ok=True)
        args.trace_out.write_text(json.dumps(log))
        print(summary(log), flush=True)


if __name__ == "__main__":
    main()
