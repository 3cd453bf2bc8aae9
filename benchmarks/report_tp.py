"""Tables (and a plot) of a tensor-parallel run of benchmarks/gpu/run_tp.sh: decode step time per tp size, and
70B serving per tp size beside the published figures users compare engines on.

    python benchmarks/report_tp.py benchmarks/results/h200x4/tp [--plot benchmarks/results/h200x4/tp/tp.png]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Published, total tok/s at 64 users, Llama-3.1-70B FP8 on H100s, input/output lengths not stated (SCALE.md):
# the documents this project answers to.
PUBLISHED_TOTAL = {
    "vLLM (published, H100)": {1: 2800, 2: 5200, 4: 9500},
    "TensorRT-LLM (published, H100)": {1: 3200, 2: 6000, 4: 11200},
}


def decode_rows(root: Path) -> list[dict]:
    rows = []
    for f in sorted(root.glob("decode*_tp*.json")):
        d = json.loads(f.read_text())
        kind = f.stem.rsplit("_tp", 1)[0].removeprefix("decode")
        for r in d["rows"]:
            rows.append({"kind": kind, "tp": r.get("tp_size", 1), **r})
    return rows


def serving_rows(root: Path) -> list[dict]:
    rows = []
    for f in sorted(root.glob("*_tp*_*.json")):  # llama...: radixlm; vllm...: vLLM beside it (run_tp.sh vllm70)
        m = re.match(r"(llama|vllm)(\w+?)_tp(\d+)_(\w+)", f.stem)
        if not m or f.stem.startswith("decode"):
            continue
        d = json.loads(f.read_text())
        rows.append(
            {
                "engine": "vLLM" if m.group(1) == "vllm" else "radixlm",
                "model": "llama" + m.group(2),
                "tp": int(m.group(3)),
                "workload": m.group(4),
                "total": d["input_throughput"] + d["output_throughput"],
                "output": d["output_throughput"],
                "ttft_p50": d["ttft_ms"]["p50"],
                "ttft_p99": d["ttft_ms"]["p99"],
                "itl_mean": d["itl_ms"]["mean"],
                "itl_p50": d["itl_ms"]["p50"],
                "itl_p90": d["itl_ms"]["p90"],
                "itl_p99": d["itl_ms"]["p99"],
                "completed": d["completed"],
                "failed": d["failed"],
            }
        )
    return with_peer_ratio(rows)


def with_peer_ratio(rows: list[dict]) -> list[dict]:
    """Each radixlm row's output tok/s over vLLM's at the same tp and workload (the issue's goal), None where
    vLLM has no such row (and on vLLM's own rows)."""
    peer = {(r["tp"], r["workload"]): r["output"] for r in rows if r["engine"] == "vLLM"}
    for r in rows:
        p = peer.get((r["tp"], r["workload"])) if r["engine"] == "radixlm" else None
        r["vs_vllm"] = r["output"] / p if p else None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    root = Path(args.root)
    dec = decode_rows(root)
    print("| weights | tp | batch | step ms | pipelined ms | tok/s (step) | tok/s (pipelined) | NCCL us/step (share) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(dec, key=lambda r: (r["kind"], r["batch"], r["tp"])):
        nccl = f"{r['collective_us']:.0f} ({r['collective_share']:.0%})" if "collective_us" in r else "-"
        print(
            f"| {r['kind'].strip('_')} | {r['tp']} | {r['batch']} | {r['step_ms']:.2f} | "
            f"{r['pipelined_step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['pipelined_tokens_per_s']:,.0f} | {nccl} |"
        )
    serve = serving_rows(root)
    print()
    print("| engine | model | tp | in/out | total tok/s | output tok/s | vs vLLM | TTFT p50 / p99 ms", end="")
    print(" | ITL mean / p50 / p90 / p99 ms | ok / failed |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(serve, key=lambda r: (r["tp"], r["workload"], r["engine"] != "radixlm", r["model"])):
        ratio = f"{r['vs_vllm']:.2f}x" if r["vs_vllm"] else "-"
        print(
            f"| {r['engine']} | {r['model']} | {r['tp']} | {r['workload'].replace('_', '/')} | {r['total']:,.0f} | "
            f"{r['output']:,.0f} | {ratio} | {r['ttft_p50']:,.0f} / {r['ttft_p99']:,.0f} | {r['itl_mean']:.1f} / "
            f"{r['itl_p50']:.1f} / {r['itl_p90']:.1f} / {r['itl_p99']:.1f} | {r['completed']} / {r['failed']} |"
        )
    if args.plot and serve:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for engine, model, workload in sorted({(r["engine"], r["model"], r["workload"]) for r in serve}):
            mine = [r for r in serve if (r["engine"], r["model"], r["workload"]) == (engine, model, workload)]
            label = f"{engine} {model} {workload.replace('_', '/')}"
            style = {"linestyle": ":" if engine == "vLLM" else "-", "marker": "s" if engine == "vLLM" else "o"}
            ax.plot(*zip(*sorted((r["tp"], r["total"]) for r in mine)), label=label, **style)
            ax2.plot(*zip(*sorted((r["tp"], r["output"]) for r in mine)), label=label, **style)
        for name, pts in PUBLISHED_TOTAL.items():
            ax.plot(list(pts), list(pts.values()), linestyle="--", marker="x", label=name)
        ax.set_ylabel("tokens/s (input + output), 64 users")
        ax2.set_ylabel("output tokens/s, 64 users")
        for a in (ax, ax2):
            a.set_xlabel("tensor-parallel GPUs")
            a.set_xticks([1, 2, 4])
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
