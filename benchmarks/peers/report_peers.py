"""The side-by-side table from run_peers.sh's results: per workload, radixlm vs the peer and their ratio.

    python benchmarks/peers/report_peers.py benchmarks/results/h100/peers [--markdown] [--plot peers.png]

Serving rows compare output tokens/s, mean TTFT and mean/p99 inter-token latency (ratio > 1 = radixlm better
for throughput, < 1 = radixlm better for latency is flipped so that > 1 always means radixlm is ahead);
offline rows compare output tokens/s. Writes DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SERVING = [
    ("random_c1", "random 512/128, c=1"),
    ("random_c32", "random 512/128, c=32"),
    ("random_c128", "random 512/128, c=128"),
    ("shared_prefix", "shared prefix 8x1500 + 40, c=64"),
    ("json", "JSON schema (response_format), c=64"),
]
OFFLINE = [("offline_random", "offline random 256 x 512/256"), ("offline_sharegpt", "offline ShareGPT-like 1000")]


def _load(d: Path, engine: str, name: str):
    f = d / f"{engine}_{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def rows(d: Path, peer: str = "vllm") -> list[dict]:
    out = []
    for name, title in SERVING:
        ours, theirs = _load(d, "radixlm", name), _load(d, peer, name)
        if not ours or not theirs:
            continue
        if name == "json":
            out.append(
                {
                    "workload": title,
                    "metric": "valid JSON",
                    "radixlm": ours["valid_json"],
                    peer: theirs["valid_json"],
                    "ratio": None,
                    "complete": True,
                }
            )
            out.append(
                {
                    "workload": title,
                    "metric": "requests/s",
                    "radixlm": ours["request_throughput"],
                    peer: theirs["request_throughput"],
                    "ratio": ours["request_throughput"] / theirs["request_throughput"]
                    if theirs["request_throughput"]
                    else None,
                    "complete": True,
                }
            )
        for metric, key, higher_better in (
            ("output tok/s", ("output_throughput",), True),
            ("TTFT mean ms", ("ttft_ms", "mean"), False),
            ("ITL mean ms", ("itl_ms", "mean"), False),
            ("ITL p99 ms", ("itl_ms", "p99"), False),
        ):
            a, b = ours, theirs
            for k in key:
                a, b = a[k], b[k]
            out.append(
                {
                    "workload": title,
                    "metric": metric,
                    "radixlm": a,
                    peer: b,
                    "ratio": (a / b if higher_better else b / a) if a and b else None,
                    "complete": ours["completed"] == theirs["completed"] and not ours["failed"] + theirs["failed"],
                }
            )
    for name, title in OFFLINE:
        ours, theirs = _load(d, "radixlm", name), _load(d, peer, name)
        if ours and theirs:
            out.append(
                {
                    "workload": title,
                    "metric": "output tok/s",
                    "radixlm": ours["output_tokens_per_s"],
                    peer: theirs["output_tokens_per_s"],
                    "ratio": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                    "complete": True,
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--peer", default="vllm")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    d = Path(args.dir)
    table = rows(d, args.peer)
    meta = {e: json.loads(f.read_text()) for e in ("radixlm", args.peer) if (f := d / f"{e}_meta.json").exists()}
    (d / "summary.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    if args.markdown:
        print(f"| workload | metric | radixlm | {args.peer} | radixlm ahead by |\n|---|---|---|---|---|")
    for r in table:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        if args.markdown:
            print(f"| {r['workload']} | {r['metric']} | {r['radixlm']:,.1f} | {r[args.peer]:,.1f} | {ratio} |")
        else:
            print(
                f"{r['workload']:<34} {r['metric']:<13} radixlm {r['radixlm']:>9.1f}  {args.peer} "
                f"{r[args.peer]:>9.1f}  ratio {ratio}{'' if r['complete'] else '  (incomplete run)'}"
            )
    if args.plot and table:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        tp = [r for r in table if r["metric"] == "output tok/s"]
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(tp) + 1.5))
        ax.barh([r["workload"] for r in tp], [r["ratio"] for r in tp], color="tab:blue")
        ax.axvline(1.0, color="k", lw=1)
        ax.set_xlabel(f"output tokens/s, radixlm / {args.peer} (>1: radixlm faster)")
        ax.set_title(
            f"{meta.get(args.peer, {}).get('gpu', 'GPU')}: radixlm vs {args.peer} "
            f"{meta.get(args.peer, {}).get('version', '')}"
        )
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
