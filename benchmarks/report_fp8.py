"""Tables (and a plot) of a one-GPU FP8 run of benchmarks/gpu/run_fp8.sh: decode per weight / KV variant beside
bf16 of the same call and the plain PyTorch graph step, offline bf16 against fp8, and 70B serving beside vLLM.

    python benchmarks/report_fp8.py benchmarks/results/h200/fp8/fused_norm [--plot .../fp8.png]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Published, other setting: TensorRT-LLM's own table, Llama-3.3-70B FP8, 1,000 in / 1,000 out, max throughput,
# output tok/s on one GPU (SCALE.md); the goal is this + 10%.
PUBLISHED_OUTPUT = {"H200": 2909}


def plain_graph(root: Path) -> dict[int, float]:
    """The anchor: ms per step of the plain PyTorch CUDA-graph decode step, by batch size."""
    f = root / "plain_graph.txt"
    if not f.exists():
        return {}
    return {
        int(m.group(1)): float(m.group(2)) for m in re.finditer(r"batch\s+(\d+):\s+([\d.]+) ms/step", f.read_text())
    }


def decode_rows(root: Path) -> list[dict]:
    """One row per (file, batch): `variant` from the file name (decode8b_fp8_head_kv8 -> 8b, fp8_head_kv8)."""
    rows = []
    for f in sorted(root.glob("decode*.json")):
        m = re.match(r"decode(\d+b)_(\w+)", f.stem)
        if not m:
            continue
        for r in json.loads(f.read_text())["rows"]:
            rows.append({"shape": m.group(1), "variant": m.group(2), **r})
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens/s over the bf16 row of the same shape, batch and context (None where there is none)."""
    base = {(r["shape"], r["batch"], r["context"]): r["tokens_per_s"] for r in rows if r["variant"] == "bf16"}
    return [r | {"vs_bf16": r["tokens_per_s"] / base[k] if (k := (r["shape"], r["batch"], r["context"])) in base
                 else None} for r in rows]  # fmt: skip


def offline_rows(root: Path) -> dict[str, float]:
    out = {}
    for f in sorted(root.glob("offline*.json")):
        out[f.stem.removeprefix("offline")] = json.loads(f.read_text())["output_tokens_per_s"]
    return out


def serving_rows(root: Path) -> list[dict]:
    """run_fp8.sh serve70 / vllm70 files: NAME_IN_OUT[_cUSERS].json."""
    rows = []
    for f in sorted(root.glob("*_*_*.json")):
        m = re.match(r"(llama|vllm)\w*?_(\d+)_(\d+)(?:_c(\d+))?$", f.stem)
        if not m:
            continue
        d = json.loads(f.read_text())
        rows.append(
            {
                "engine": "vLLM" if m.group(1) == "vllm" else "radixlm",
                "name": f.stem,
                "workload": f"{m.group(2)}/{m.group(3)}",
                "users": int(m.group(4) or 64),
                "output": d["output_throughput"],
                "total": d["input_throughput"] + d["output_throughput"],
                "ttft": (d["ttft_ms"]["p50"], d["ttft_ms"]["p99"]),
                "itl": (d["itl_ms"]["p50"], d["itl_ms"]["p99"]),
                "ok": (d["completed"], d["failed"]),
            }
        )
    return rows


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    root = Path(args.root)
    anchor = plain_graph(root)
    if anchor:
        print("plain PyTorch graph step (anchor):", ", ".join(f"batch {b}: {ms:.2f} ms" for b, ms in anchor.items()))
    dec = with_ratios(decode_rows(root))
    print("\n| shape | variant | context | batch | step ms | pipelined ms | tok/s | vs bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(dec, key=lambda r: (r["shape"], r["variant"] != "bf16", r["variant"], r["batch"])):
        print(
            f"| {r['shape']} | {r['variant']} | {r['context']} | {r['batch']} | {r['step_ms']:.2f} | "
            f"{r.get('pipelined_step_ms', float('nan')):.2f} | {r['tokens_per_s']:,.0f} | {_x(r['vs_bf16'])} |"
        )
    off = offline_rows(root)
    if off:
        base = next((v for k, v in off.items() if k.endswith("_none")), None)
        print("\n| offline | output tok/s | vs bf16 |\n|---|---:|---:|")
        for k, v in off.items():
            print(f"| {k} | {v:,.0f} | {_x(v / base if base else None)} |")
    serve = serving_rows(root)
    if serve:
        peer = {(r["workload"], r["users"]): r["output"] for r in serve if r["engine"] == "vLLM"}
        print(
            "\n| engine | run | users | output tok/s | total tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | vs vLLM |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in sorted(serve, key=lambda r: (r["workload"], r["users"], r["engine"])):
            vs = r["output"] / peer[k] if r["engine"] != "vLLM" and (k := (r["workload"], r["users"])) in peer else None
            print(
                f"| {r['engine']} | {r['name']} | {r['users']} | {r['output']:,.0f} | {r['total']:,.0f} | "
                f"{r['ttft'][0]:,.0f} / {r['ttft'][1]:,.0f} | {r['itl'][0]:.1f} / {r['itl'][1]:.1f} | {_x(vs)} |"
            )
        for card, tok in PUBLISHED_OUTPUT.items():
            print(f"published (TensorRT-LLM, Llama-3.3-70B FP8, 1,000/1,000, max throughput, one {card}): {tok:,}")
    if args.plot and (dec or serve):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for shape, variant in sorted({(r["shape"], r["variant"]) for r in dec}):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in dec if (r["shape"], r["variant"]) == (shape, variant))
            ax.plot(*zip(*pts), marker="o", label=f"{shape} {variant}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode batch")
        ax.set_ylabel("tokens/s (one step)")
        for engine in ("radixlm", "vLLM"):
            pts = sorted((r["users"], r["output"]) for r in serve if r["engine"] == engine)
            if pts:
                ax2.plot(*zip(*pts), marker="o" if engine == "radixlm" else "s", label=engine)
        for card, tok in PUBLISHED_OUTPUT.items():
            ax2.axhline(tok, linestyle="--", color="grey", label=f"TensorRT-LLM published ({card}, max throughput)")
        ax2.set_xlabel("concurrent users (70B FP8, 1,000 in / 1,000 out)")
        ax2.set_ylabel("output tokens/s")
        for a in (ax, ax2):
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
