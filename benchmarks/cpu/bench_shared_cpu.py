"""CPU decode when the cores are shared: batch 1, 2 and 8 alone and with other processes busy on every core,
under the wait policy radixlm sets by default (OMP_WAIT_POLICY=PASSIVE) and under OpenMP's own default
(threads spin for a while after each parallel region: GOMP_SPINCOUNT=300000, libgomp's value when nothing is
set).

Each configuration runs bench_decode.py in a fresh process (OpenMP reads its wait policy once, at load). The
busy load is one pure-Python spinning process per usable CPU at the same priority, which is what a shared host
or a second service in the same container looks like to the scheduler.

    python benchmarks/cpu/bench_shared_cpu.py --out benchmarks/results/cpu-2core/shared_cpu.json [--plot]

Goal (issue 28): batch 2 under load <= 2x batch 1 under load (a collapse, seconds per step, without it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLICIES = {
    "passive (radixlm default)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin (OpenMP default)": {"GOMP_SPINCOUNT": "300000"},
}


def _spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _decode(env_extra: dict, batches: list[int], context: int, repeats: int, quantization: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_extra
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "bench_decode.py"),
            "--batch-sizes",
            *map(str, batches),
            "--context",
            str(context),
            "--repeats",
            str(repeats),
            "--quantization",
            quantization,
            "--out",
            str(out),
        ]
        subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--busy", type=int, default=None, help="spinning processes (default: one per usable CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from radixlm.srt.cpu_threads import usable_cpus

    busy = args.busy if args.busy is not None else usable_cpus()
    rows = []
    for policy, env in POLICIES.items():
        for load in ("alone", "busy"):
            spinners = _spinners(busy) if load == "busy" else []
            try:
                time.sleep(0.5 if spinners else 0)
                result = _decode(env, args.batch_sizes, args.context, args.repeats, args.quantization)
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()
            for r in result["rows"]:
                rows.append(
                    {
                        "policy": policy,
                        "load": load,
                        "busy_processes": busy if spinners else 0,
                        "batch": r["batch"],
                        "step_ms": r["step_ms"],
                        "tokens_per_s": r["tokens_per_s"],
                    }
                )
                print(
                    f"{policy:>26} {load:>5} batch {r['batch']:3d}: {r['step_ms']:9.2f} ms/step "
                    f"{r['tokens_per_s']:8.1f} tok/s",
                    flush=True,
                )
    by = {(r["policy"], r["load"], r["batch"]): r["step_ms"] for r in rows}
    print("\nbatch 2 / batch 1 step time under load:")
    for policy in POLICIES:
        one, two = by.get((policy, "busy", 1)), by.get((policy, "busy", 2))
        if one and two:
            print(f"  {policy}: {two / one:.2f}x (goal <= 2x)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "cpu": _cpu_name(),
                    "usable_cpus": usable_cpus(),
                    "context": args.context,
                    "quantization": args.quantization,
                    "load_average": os.getloadavg(),
                    "rows": rows,
                },
                indent=2,
            )
        )
    if args.plot and args.out:
        _plot(rows, Path(args.out).with_suffix(".png"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in POLICIES:
        for load, style in (("alone", "-"), ("busy", "--")):
            pts = [(r["batch"], r["step_ms"]) for r in rows if r["policy"] == policy and r["load"] == load]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"{policy}, {load}")
    ax.set(xlabel="batch", ylabel="ms per decode step", yscale="log", title="CPU decode with the cores shared")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
