"""Table and plot of the GPU fast-path results in one folder: decode tokens/s per backend against batch size,
beside the plain PyTorch CUDA-graph step measured in the same run and the HBM floor; offline and serving rows.

    python benchmarks/report_fastpath.py benchmarks/results/h100/fastpath [--plot decode.png]

Reads decode_<backend>.json (bench_decode.py), plain_graph.txt (../shared/gpu/plain_graph_decode.py),
offline_*.json (bench_offline.py) and serving/<config>/*.json (bench_serving.py); prints markdown.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Llama-3.1-8B in bf16: 16.06 GB of weights; 128 KiB of K+V per token (32 layers x 8 heads x 128 x 2 x 2 B).
WEIGHT_BYTES = 16.06e9
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2
FLOOR_BW = WEIGHT_BYTES / 5.3e-3  # the floor: 5.3 ms per batch-1 step (about 3.0 TB/s sustained)


def floor_ms(batch: int, context: int) -> float:
    return (WEIGHT_BYTES + batch * context * KV_BYTES_PER_TOKEN) / FLOOR_BW * 1e3


def load(folder: Path) -> tuple[dict, dict]:
    decode = {}
    for f in sorted(folder.glob("decode_*.json")):
        d = json.loads(f.read_text())
        for row in d["rows"]:
            decode.setdefault(row["backend"], {})[row["batch"]] = row
    anchor = {}
    plain = folder / "plain_graph.txt"
    if plain.exists():
        for m in re.finditer(r"batch\s+(\d+):\s+([\d.]+) ms/step", plain.read_text()):
            anchor[int(m.group(1))] = float(m.group(2))
    return decode, anchor


def decode_table(decode: dict, anchor: dict) -> str:
    batches = sorted({b for rows in decode.values() for b in rows} | set(anchor))
    ctx = next(iter(next(iter(decode.values())).values()))["context"] if decode else 512
    lines = [
        "| batch | " + " | ".join(f"{b} ms / tok/s" for b in decode) + " | plain graph ms / tok/s | "
        "HBM floor ms | best vs plain |",
        "|---:|" + "---:|" * (len(decode) + 3),
    ]
    for bs in batches:
        cells, best = [], None
        for rows in decode.values():
            r = rows.get(bs)
            piped = f" ({r['pipelined_step_ms']:.2f} pipelined)" if r and "pipelined_step_ms" in r else ""
            cells.append(
                f"{r['step_ms']:.2f} / {r['tokens_per_s']:,.0f}{'' if r['cuda_graph'] else ' (eager)'}{piped}"
                if r
                else ""
            )
            if r and r["cuda_graph"]:
                best = min(best or r["step_ms"], r["step_ms"])
        a = anchor.get(bs)
        ratio = f"{a / best:.2f}x" if a and best else ""
        lines.append(f"| {bs} | " + " | ".join(cells) + f" | {a:.2f} / {bs / a * 1e3:,.0f} | " if a else "| |")
        lines[-1] = lines[-1] + f"{floor_ms(bs, ctx):.2f} | {ratio} |"
    return "\n".join(lines)


def offline_rows(folder: Path) -> str:
    lines = []
    for f in sorted(folder.glob("offline_*.json")):
        d = json.loads(f.read_text())
        lines.append(
            f"- {d['workload']}: {d['num_prompts']} prompts, {d['input_tokens']:,} in / "
            f"{d['output_tokens']:,} out tokens in {d['seconds']:.1f} s = "
            f"{d['output_tokens_per_s']:,.0f} output tok/s ({d['attention_backend']}, "
            f"{d['decode_steps']} decode + {d['extend_steps']} extend steps)"
        )
    return "\n".join(lines)


def serving_table(folder: Path) -> str:
    lines = [
        "| config | load | ok / aborted | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | (E2E-TTFT)/token ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for cfg in sorted((folder / "serving").glob("*")):
        for f in sorted(cfg.glob("*.json")):
            if f.name == "server_info.json":
                continue
            d = json.loads(f.read_text())
            per_tok = (d["e2e_ms"]["mean"] - d["ttft_ms"]["mean"]) / max(d["mean_output_tokens"] - 1, 1)
            lines.append(
                f"| {cfg.name} | {d['label']} | {d['completed']} / {d.get('aborted', 0)} | "
                f"{d['output_throughput']:,.0f} | {d['ttft_ms']['p50']:.0f} / {d['ttft_ms']['p99']:.0f} | "
                f"{d['itl_ms']['p50']:.1f} / {d['itl_ms']['p99']:.1f} | {per_tok:.1f} |"
            )
    return "\n".join(lines)


def plot(decode: dict, anchor: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ctx = 512
    for backend, rows in decode.items():
        bs = sorted(rows)
        ctx = rows[bs[0]]["context"]
        (line,) = ax.plot(
            bs, [rows[b]["tokens_per_s"] for b in bs], "o-", label=f"radixlm {backend}, one step at a time"
        )
        piped = [b for b in bs if "pipelined_tokens_per_s" in rows[b]]
        if piped:  # as the overlap scheduler runs steps: the next launched before this one's ids are read
            ax.plot(
                piped,
                [rows[b]["pipelined_tokens_per_s"] for b in piped],
                "^--",
                color=line.get_color(),
                label=f"radixlm {backend}, pipelined",
            )
    if anchor:
        bs = sorted(anchor)
        ax.plot(bs, [b / anchor[b] * 1e3 for b in bs], "s--", color="gray", label="plain PyTorch + CUDA graph")
        ax.plot(bs, [b / floor_ms(b, ctx) * 1e3 for b in bs], ":", color="black", label="HBM floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-3.1-8B shape, bf16, context {ctx}, one H100")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    decode, anchor = load(args.folder)
    print("### Decode step (bench_decode.py --context 512)\n\n" + decode_table(decode, anchor))
    print("\n### Offline (bench_offline.py)\n\n" + offline_rows(args.folder))
    if (args.folder / "serving").exists():
        print("\n### Serving (bench_serving.py via run_serving.sh)\n\n" + serving_table(args.folder))
    if args.plot:
        plot(decode, anchor, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
