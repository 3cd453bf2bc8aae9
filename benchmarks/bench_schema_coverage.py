"""Real-world JSON-schema coverage per grammar backend: 400 schemas nobody here wrote (a seeded, stratified sample
of JSONSchemaBench, `benchmarks/data/jsonschemabench_sample.jsonl`) through radixlm's own edge check and grammar
manager, as a request meets them.

Per backend (and `auto`, which picks one per schema):
- edge: accepted, refused with a 400 naming a keyword (which keywords, how often), or not a valid schema at all
  (the Draft 2020-12 meta-schema check); how long the check took (it runs in the HTTP process);
- compile, one at a time: compile errors and crashes after the edge accepted (both should be 0: what cannot be
  compiled should have been refused at the edge), timeouts, compile time p50 / p95 / max;
- compile, 60 at once (the server's 4 workers): timeouts, failures, wall time;
- generate (`--generate K`): K accepted schemas answered by the embedded model at temperature 0.7; the share of
  finished answers that validate (jsonschema, formats checked) must be 100%; answers cut by the token limit are
  counted apart.

    python benchmarks/bench_schema_coverage.py --out benchmarks/results/cpu-2core/schema_coverage.json
    python benchmarks/bench_schema_coverage.py --backends auto,llguidance --generate 40 --plot cov.png
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from radixlm.srt.constrained.manager import GrammarManager, create_backend  # noqa: E402
from radixlm.srt.constrained.spec import AUTO_ORDER, check_supported, grammar_spec  # noqa: E402
from radixlm.srt.errors import GrammarError, GrammarTimeout  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "jsonschemabench_sample.jsonl"
_KEYWORD = re.compile(r"'([^']+)' at #")
_LLG_KEYS = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def load(path: Path = DATA) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def refused_keyword(message: str) -> str:
    """The keyword a refusal names (the first one), for the table of refusals."""
    m = _KEYWORD.search(message) or _LLG_KEYS.search(message)
    if m:
        return m.group(1).split(",")[0].strip().strip('"')
    if "format" in message.lower():
        return "format"
    return message.split(":")[-1].strip()[:40]


def edge(items: list[dict], backend: str) -> list[dict]:
    """The edge's verdict on every schema: accepted (with the backend auto chose), refused or invalid."""
    out = []
    for it in items:
        t0 = time.perf_counter()
        rec = {"subset": it["subset"], "id": it["id"]}
        try:
            spec = grammar_spec(json_schema=it["schema"])
        except GrammarError as e:
            rec.update(verdict="invalid", message=e.message[:200])
        else:
            try:
                rec.update(verdict="accepted", chosen=check_supported(spec, backend))
                rec["spec"] = spec
            except GrammarError as e:
                rec.update(verdict="refused", keyword=refused_keyword(e.message), message=e.message[:300])
        rec["edge_ms"] = (time.perf_counter() - t0) * 1e3
        out.append(rec)
    return out


def _wait(manager: GrammarManager, tickets: list) -> list:
    results = [None] * len(tickets)
    while any(r is None for r in results):
        for i, t in enumerate(tickets):
            if results[i] is None:
                results[i] = t.poll()
        time.sleep(0.002)
    return results


def _classify(result) -> str:
    if isinstance(result, GrammarTimeout):
        return "timeout"
    if isinstance(result, GrammarError):
        # the manager turns a backend's unexpected exception into a GrammarError naming its type
        return (
            "crash"
            if re.search(r"cannot be compiled: [A-Z]\w+(Error|Exception|Panic)\b", result.message)
            else "compile_error"
        )
    return "ok"


def compile_alone(backend_obj, accepted: list[dict], timeout: float) -> dict:
    manager = GrammarManager(backend_obj, workers=1, timeout=timeout)
    times, kinds, failures = [], collections.Counter(), []
    for rec in accepted:
        t0 = time.perf_counter()
        result = _wait(manager, [manager.request(rec["spec"])])[0]
        dt = time.perf_counter() - t0
        kind = _classify(result)
        kinds[kind] += 1
        if kind == "ok":
            times.append(dt)
        else:
            failures.append({"subset": rec["subset"], "id": rec["id"], "kind": kind, "message": result.message[:300]})
            if kind == "timeout":
                manager.forget(rec["spec"])
    manager.shutdown()
    return {
        "ok": kinds["ok"],
        "compile_errors": kinds["compile_error"],
        "crashes": kinds["crash"],
        "timeouts": kinds["timeout"],
        "compile_s": _summary(times),
        "failures": failures,
    }


def compile_at_once(backend_obj, accepted: list[dict], n: int, timeout: float, seed: int) -> dict:
    picked = random.Random(seed).sample(accepted, min(n, len(accepted)))
    manager = GrammarManager(backend_obj, workers=4, timeout=timeout)
    t0 = time.perf_counter()
    results = _wait(manager, [manager.request(rec["spec"]) for rec in picked])
    wall = time.perf_counter() - t0
    manager.shutdown()
    kinds = collections.Counter(_classify(r) for r in results)
    return {
        "n": len(picked),
        "ok": kinds["ok"],
        "timeouts": kinds["timeout"],
        "failures": kinds["compile_error"] + kinds["crash"],
        "wall_s": round(wall, 2),
    }


def _summary(values: list[float]) -> dict:
    return (
        {
            "p50": round(pct(values, 50), 4),
            "p95": round(pct(values, 95), 4),
            "max": round(max(values), 4),
            "mean": round(statistics.mean(values), 4),
        }
        if values
        else {}
    )


def _validator(schema: dict):
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def generate(backend: str, accepted: list[dict], k: int, seed: int, max_new_tokens: int) -> dict:
    import radixlm

    picked = random.Random(seed).sample(accepted, min(k, len(accepted)))
    engine = radixlm.Engine(log_level="warning", grammar_backend=backend, max_total_tokens=32768)
    chat = [
        engine.chat_ids(
            [
                {
                    "role": "user",
                    "content": "Write one realistic JSON example of a "
                    f"{rec['subset']} record ({rec['id']}). Answer with JSON only.",
                }
            ]
        )
        for rec in picked
    ]
    params = [
        {"json_schema": json.loads(rec["spec"].spec), "temperature": 0.7, "seed": i, "max_new_tokens": max_new_tokens}
        for i, rec in enumerate(picked)
    ]
    t0 = time.perf_counter()
    outs = []
    for ids, p in zip(chat, params):  # one at a time: a failure names its schema
        try:
            outs.append(engine.generate(input_ids=ids, sampling_params=p))
        except GrammarError as e:
            outs.append({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": e.message}}})
    wall = time.perf_counter() - t0
    finished = valid = cut = failed = 0
    invalid = []
    for rec, out in zip(picked, outs):
        reason = out["meta_info"]["finish_reason"] or {}
        if reason.get("type") == "length":
            cut += 1
            continue
        if reason.get("type") != "stop":
            failed += 1
            invalid.append({"id": rec["id"], "reason": reason})
            continue
        finished += 1
        schema = json.loads(rec["spec"].spec)
        try:
            errors = [e.message for e in _validator(schema).iter_errors(json.loads(out["text"]))]
        except json.JSONDecodeError as e:
            errors = [f"not JSON: {e}"]
        if errors:
            invalid.append({"subset": rec["subset"], "id": rec["id"], "text": out["text"][:300], "errors": errors[:3]})
        else:
            valid += 1
    return {
        "n": len(picked),
        "finished": finished,
        "valid": valid,
        "cut_by_limit": cut,
        "failed": failed,
        "valid_share": round(valid / finished, 4) if finished else None,
        "wall_s": round(wall, 1),
        "invalid": invalid,
    }


def run_backend(backend: str, items: list[dict], tokenizer, vocab: int, args) -> dict:
    verdicts = edge(items, backend)
    accepted = [v for v in verdicts if v["verdict"] == "accepted"]
    refused = [v for v in verdicts if v["verdict"] == "refused"]
    row = {
        "backend": backend,
        "schemas": len(items),
        "accepted": len(accepted),
        "refused": len(refused),
        "invalid": sum(v["verdict"] == "invalid" for v in verdicts),
        "refused_by_keyword": dict(collections.Counter(v["keyword"] for v in refused).most_common()),
        "edge_ms": _summary([v["edge_ms"] for v in verdicts]),
        "accepted_by_subset": dict(collections.Counter(v["subset"] for v in accepted)),
    }
    if backend == "auto":
        row["chosen"] = dict(collections.Counter(v["chosen"] for v in accepted))
    backend_obj = create_backend(backend, tokenizer, vocab, [tokenizer.eos_token_id])
    if backend == "auto":
        for name in AUTO_ORDER:  # built before timing, as a server has them once the first request needed them
            backend_obj.backend(name)
    else:
        backend_obj.compile(grammar_spec(json_schema={"type": "object"}))
    row["alone"] = compile_alone(backend_obj, accepted, args.timeout)
    row["at_once"] = compile_at_once(
        create_backend(backend, tokenizer, vocab, [tokenizer.eos_token_id]),
        accepted,
        args.at_once,
        args.timeout,
        args.seed,
    )
    broken = {(f["subset"], f["id"]) for f in row["alone"]["failures"]}
    if args.generate:
        ok = [v for v in accepted if (v["subset"], v["id"]) not in broken]
        row["generate"] = generate(backend, ok, args.generate, args.seed, args.max_new_tokens)
    return row


def table(rows: list[dict]) -> str:
    head = (
        f"{'backend':<11} {'accepted':>9} {'refused':>8} {'invalid':>8} {'errors':>7} {'crashes':>8} "
        f"{'timeouts':>9} {'p50 s':>7} {'p95 s':>7} {'max s':>7} {'60 at once':>16} {'valid gen':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        a, c, g = r["alone"], r["alone"]["compile_s"], r.get("generate")
        once = f"{r['at_once']['timeouts']} t/o {r['at_once']['wall_s']:.1f} s"
        gen = f"{g['valid']}/{g['finished']}" if g else "-"
        lines.append(
            f"{r['backend']:<11} {r['accepted']:>4} ({r['accepted'] / r['schemas']:.0%}) {r['refused']:>8} "
            f"{r['invalid']:>8} {a['compile_errors']:>7} {a['crashes']:>8} {a['timeouts']:>9} "
            f"{c.get('p50', 0):>7.3f} {c.get('p95', 0):>7.3f} {c.get('max', 0):>7.2f} {once:>16} {gen:>10}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["backend"] for r in rows]
    ax1.bar(names, [r["accepted"] for r in rows], label="accepted")
    ax1.bar(names, [r["refused"] for r in rows], bottom=[r["accepted"] for r in rows], label="refused (400)")
    ax1.set_ylabel(f"schemas of {rows[0]['schemas']}")
    ax1.legend()
    ax2.bar(names, [r["alone"]["compile_s"].get("p95", 0) for r in rows])
    ax2.set_yscale("log")
    ax2.set_ylabel("compile time p95 (s)")
    fig.suptitle("JSONSchemaBench sample: coverage and compile time by grammar backend")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="auto,llguidance,xgrammar,outlines")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the embedded SmolLM2's)")
    ap.add_argument("--timeout", type=float, default=30.0, help="compile time limit (the server's default)")
    ap.add_argument("--at-once", type=int, default=60)
    ap.add_argument("--generate", type=int, default=0, help="accepted schemas to answer with the embedded model")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON results path")
    ap.add_argument("--plot", help="PNG path")
    args = ap.parse_args()
    items = load(Path(args.data))
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from radixlm.srt.model_loader.default_model import default_model_path
        from radixlm.srt.model_loader.gguf_loader import GGUFCheckpoint

        tokenizer = GGUFCheckpoint(default_model_path()).load_tokenizer()
    rows = []
    for backend in args.backends.split(","):
        t0 = time.perf_counter()
        rows.append(run_backend(backend, items, tokenizer, len(tokenizer), args))
        print(f"{backend}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(table(rows))
    result = {
        "machine": platform.node(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "data": str(Path(args.data).name),
        "timeout_s": args.timeout,
        "rows": rows,
        "command": " ".join(sys.argv),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
