"""The table of run_cpu_peers.sh: radixlm vs llama.cpp on CPU, decode step and serving, with issue 12's targets.

    python benchmarks/cpu/report_cpu_peers.py DEST [--markdown] [--plot FILE.png]

Reads DEST/{radixlm_decode_none,radixlm_decode_gguf,llamacpp_decode}.json (bench_decode / llamacpp_decode),
DEST/{radixlm,llamacpp}_serving_random.json (bench_serving), the servers' logs and ready times; prints what it
finds (missing files are skipped), writes DEST/summary.json and, when matplotlib is importable, a bar chart
(DEST/peers.png unless --plot says otherwise). Ratios are always ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# Issue 12's figures to reach, as (what, predicate on the summary); a missing figure is reported as "n/a".
TARGETS = [
    ("batch-1 decode >= llama.cpp single stream", lambda s: _best(s, 1) / s["decode"]["llamacpp_b1"] >= 1),
    ("batch-16 decode >= 600 tok/s", lambda s: _best(s, 16) >= 600),
    ("serving out tok/s >= 4x llama.cpp", lambda s: s["serving"]["output tok/s"]["ratio"] >= 4),
    ("serving ITL mean <= 2x llama.cpp", lambda s: s["serving"]["ITL mean ms"]["ratio"] <= 2),
    ("model load <= 2 s", lambda s: s["load"]["radixlm_load_s"] <= 2),
]
SERVING = [
    ("output tok/s", ("output_throughput",)),
    ("requests/s", ("request_throughput",)),
    ("TTFT mean ms", ("ttft_ms", "mean")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("ITL mean ms", ("itl_ms", "mean")),
    ("E2E mean ms", ("e2e_ms", "mean")),
]


def _best(s: dict, batch: int) -> float:
    """Our best tok/s at `batch` over the quantizations measured (the target holds for whichever path is faster)."""
    return max(v for q in ("none", "gguf") if (v := s["decode"][f"{q}_b{batch}"]) is not None)


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _tok_s(report: dict | None, batch: int) -> float | None:
    rows = [r for r in (report or {}).get("rows", []) if r["batch"] == batch]
    return rows[0]["tokens_per_s"] if rows else None


def summarize(d: Path) -> dict:
    decode: dict[str, float | None] = {"llamacpp_b1": _tok_s(_json(d / "llamacpp_decode.json"), 1)}
    for q in ("none", "gguf"):
        report = _json(d / f"radixlm_decode_{q}.json")
        decode[f"{q}_b1"], decode[f"{q}_b16"] = _tok_s(report, 1), _tok_s(report, 16)
    serving: dict[str, dict] = {}
    ours, theirs = _json(d / "radixlm_serving_random.json"), _json(d / "llamacpp_serving_random.json")
    if ours and theirs:
        for name, keys in SERVING:
            a, b = ours, theirs
            for k in keys:
                a, b = a[k], b[k]
            serving[name] = {"radixlm": a, "llamacpp": b, "ratio": a / b if b else None}
        serving["completed/failed"] = {
            "radixlm": [ours["completed"], ours["failed"]],
            "llamacpp": [theirs["completed"], theirs["failed"]],
            "ratio": None,
        }
    load: dict[str, float | None] = {"radixlm_load_s": None}
    log = d / "radixlm_server.log"
    # Our loader logs "loaded NAME (...) in X.X s" at info level (srt/model_loader/loader.py).
    m = re.search(r"loaded .* in ([0-9.]+) s", log.read_text(errors="replace")) if log.exists() else None
    if m:
        load["radixlm_load_s"] = float(m.group(1))
    for engine in ("radixlm", "llamacpp"):
        f = d / f"{engine}_ready_s.txt"
        load[f"{engine}_ready_s"] = float(f.read_text()) if f.exists() else None
    return {"meta": _json(d / "meta.json") or {}, "decode": decode, "serving": serving, "load": load}


def _f(v: float | None, fmt: str = ",.1f", unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


def render(s: dict, markdown: bool) -> list[str]:
    dec, out = s["decode"], []
    row = (
        (lambda *c: "| " + " | ".join(c) + " |")
        if markdown
        else (lambda *c: "  ".join(f"{x:>13}" if i else f"{x:<26}" for i, x in enumerate(c)))
    )
    llama = dec["llamacpp_b1"]
    out += ["decode step, context 64 (tok/s)", row("", "batch 1", "batch 16", "b1 / llama.cpp")]
    if markdown:
        out.append("|---|---:|---:|---:|")
    for q in ("none", "gguf"):
        b1 = dec[f"{q}_b1"]
        out.append(
            row(
                f"radixlm --quantization {q}",
                _f(b1),
                _f(dec[f"{q}_b16"]),
                _f(b1 / llama if b1 and llama else None, ".2f", "x"),
            )
        )
    out += [row("llama.cpp (single stream)", _f(llama), "-", "1.00x"), ""]
    if s["serving"]:
        out += ["serving random (bench_serving)", row("", "radixlm", "llama.cpp", "ours / llama.cpp")]
        if markdown:
            out.append("|---|---:|---:|---:|")
        for name, v in s["serving"].items():
            if name == "completed/failed":
                out.append(row(name, "/".join(map(str, v["radixlm"])), "/".join(map(str, v["llamacpp"])), "-"))
            else:
                out.append(row(name, _f(v["radixlm"]), _f(v["llamacpp"]), _f(v["ratio"], ".2f", "x")))
        out += [("\n" if markdown else "") + "(ratio > 1: ours ahead on tok/s and req/s, behind on the ms rows)", ""]
    ld = s["load"]
    out.append(
        f"radixlm model load {_f(ld['radixlm_load_s'], '.2f')} s (server log); ready after: radixlm "
        f"{_f(ld['radixlm_ready_s'], '.2f')} s, llama.cpp {_f(ld['llamacpp_ready_s'], '.2f')} s"
    )
    for what, ok in TARGETS:
        try:
            verdict = "met" if ok(s) else "NOT met"
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            verdict = "n/a"
        out.append(f"target: {what}: {verdict}")
    return out


def plot(s: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = s["decode"]
    bars = [
        ("ours fp32 b1", dec["none_b1"]),
        ("ours fp32 b16", dec["none_b16"]),
        ("ours gguf b1", dec["gguf_b1"]),
        ("ours gguf b16", dec["gguf_b16"]),
        ("llama.cpp b1", dec["llamacpp_b1"]),
    ]
    bars = [(n, v) for n, v in bars if v is not None]
    if not bars and not s["serving"]:
        return False
    srv = [(k, s["serving"][k]) for k in ("output tok/s", "ITL mean ms", "TTFT mean ms") if k in s["serving"]]
    fig, axes = plt.subplots(1, 1 + len(srv), figsize=(4 + 2.6 * len(srv), 3.6), squeeze=False)
    ax = axes[0][0]
    ax.bar([n for n, _ in bars], [v for _, v in bars], color=["C0"] * (len(bars) - 1) + ["C1"])
    ax.set_title("decode step, ctx 64 (tok/s)", fontsize=9)
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    for ax, (name, v) in zip(axes[0][1:], srv):
        ax.bar(["radixlm", "llama.cpp"], [v["radixlm"], v["llamacpp"]], color=["C0", "C1"])
        ax.set_title(f"serving: {name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", default=None, help="PNG path (default DIR/peers.png when matplotlib is importable)")
    args = ap.parse_args()
    d = Path(args.dir)
    s = summarize(d)
    (d / "summary.json").write_text(json.dumps(s, indent=2))
    m = s["meta"]
    if m:
        print(
            f"{m.get('cpu')}, {m.get('threads')} threads; radixlm {m.get('radixlm_commit')} ({m.get('ours_flags')}), "
            f"llama-cpp-python {m.get('llama_cpp_python')}, torch {m.get('torch')}"
        )
    print("\n".join(render(s, args.markdown)))
    png = Path(args.plot) if args.plot else d / "peers.png"
    if plot(s, png):
        print(f"plot: {png}")


if __name__ == "__main__":
    main()
