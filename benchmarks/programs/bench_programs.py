"""Multi-call programs (the workloads of the SGLang paper) on our server, radix cache on vs off, and the
chat-shaped ones also as plain OpenAI-client calls (no DSL) against the same server.

No public dataset can be fetched here (no Hugging Face hub), so every workload is generated from a seed:
questions, documents and few-shot examples are built from a word list, shaped like the paper's (k-shot
multiple choice with shared examples, 4-way continuation choice, 4-turn chat with a long system prompt,
tree-of-thought 3 x 3, JSON extraction, a ReAct trace, RAG over a shared document).

    python benchmarks/programs/bench_programs.py --out benchmarks/results/cpu-2core/programs.json --plot p.png
    python benchmarks/programs/bench_programs.py --url http://127.0.0.1:30000   # a server you started

Each workload reports programs/s and the server's cache hit rate over the run (cached / prompt tokens).
Before timing, every selected workload runs once untimed on a few programs (both clients), so the first
workload does not pay the server's or the clients' start-up costs (first connections, lazy compilation, the
JSON schema's grammar). With `--repeats N` each measurement runs N times, the cache flushed before each run,
the DSL and plain-client runs of a workload alternating on the cache-on server (DSL first on even repeats,
plain first on odd ones); each result then reports the median of each measure and keeps every run under
"runs" (its other keys are those a single run had, so readers of earlier results read these too).
client_overhead.py splits the DSL's and the plain client's per-call time into client and server parts.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import httpx

import radixlm as sgl

WORDS = (
    "river mountain ocean forest city garden window table music story letter energy system market family "
    "school country question answer history science light stone bridge cloud winter summer morning evening "
    "dream voice color paper animal planet engine doctor farmer teacher artist"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# --- programs ---------------------------------------------------------------------------------------------
@sgl.function
def kshot_mc(s, shots, question, choices):
    s += shots + "Question: " + question + "\nAnswer:"
    s += sgl.select("answer", choices=choices)


@sgl.function
def hellaswag(s, context, endings):
    s += "Complete the description.\n" + context
    s += sgl.select("ending", choices=endings)


@sgl.function
def multi_turn(s, system, questions, max_tokens):
    s += sgl.system(system)
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=max_tokens))


@sgl.function
def tree_of_thought(s, question, max_tokens):
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += "Let us think in three ways.\n"
    plans = s.fork(3)
    for i, p in enumerate(plans):
        p += f"Way {i + 1}:" + sgl.gen("plan", max_tokens=max_tokens, stop="\n")
        steps = p.fork(3)
        for j, st in enumerate(steps):
            st += f"\nStep {j + 1}:" + sgl.gen("step", max_tokens=max_tokens, stop="\n")
        steps.join()
    plans.join()
    s += "\nSo the answer is" + sgl.gen("final", max_tokens=max_tokens, stop="\n")
    s += sgl.assistant_end()


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "city": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}


@sgl.function
def json_extract(s, instructions, text):
    s += instructions + "Text: " + text + "\nJSON: "
    s += sgl.gen("json", max_tokens=48, json_schema=PERSON)


@sgl.function
def react(s, tools_doc, question, steps, max_tokens):
    s += tools_doc + "Question: " + question + "\n"
    for i in range(steps):
        s += f"Thought {i + 1}:" + sgl.gen(f"t{i}", max_tokens=max_tokens, stop="\n")
        s += f"\nAction {i + 1}: " + sgl.select(f"act{i}", choices=["search", "lookup", "finish"])
        s += f"\nObservation {i + 1}: " + words(random.Random(i), 12) + "\n"


@sgl.function
def rag(s, document, question, max_tokens):
    s += sgl.system("Answer from the document.\n" + document)
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_tokens))


def workloads(scale: int, seed: int) -> dict:
    rng = random.Random(seed)
    shots = "".join(f"Question: {words(rng, 20)}?\nAnswer: {rng.choice(['A', 'B', 'C', 'D'])}\n\n" for _ in range(5))
    doc = words(rng, 600)
    system = "You are a careful assistant. " + words(rng, 400)
    tools = "Tools: search[query], lookup[term], finish[answer].\n" + words(rng, 200) + "\n"
    instructions = "Extract the person as JSON with name, city and age.\n" + words(rng, 150) + "\n"
    n = scale
    return {
        "kshot_mc": (
            kshot_mc,
            [{"shots": shots, "question": words(rng, 15) + "?", "choices": ["A", "B", "C", "D"]} for _ in range(4 * n)],
        ),
        "hellaswag": (
            hellaswag,
            [{"context": words(rng, 40), "endings": [" " + words(rng, 8) for _ in range(4)]} for _ in range(4 * n)],
        ),
        "multi_turn_chat": (
            multi_turn,
            [
                {"system": system, "questions": [words(rng, 10) + "?" for _ in range(4)], "max_tokens": 8}
                for _ in range(n)
            ],
        ),
        "tree_of_thought": (
            tree_of_thought,
            [{"question": words(rng, 12) + "?", "max_tokens": 6} for _ in range(max(1, n // 4))],
        ),
        "json_extraction": (
            json_extract,
            [
                {"instructions": instructions, "text": f"{rng.choice(WORDS)} lives in {rng.choice(WORDS)}"}
                for _ in range(2 * n)
            ],
        ),
        "react_agent": (
            react,
            [{"tools_doc": tools, "question": words(rng, 10) + "?", "steps": 3, "max_tokens": 8} for _ in range(n)],
        ),
        "rag_shared_document": (
            rag,
            [{"document": doc, "question": words(rng, 10) + "?", "max_tokens": 8} for _ in range(2 * n)],
        ),
    }


def server_stats(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["scheduler"]


def _counts(url: str, before: dict, n: int, secs: float) -> dict:
    after = server_stats(url)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {
        "programs": n,
        "seconds": secs,
        "programs_per_s": n / secs,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
    }


def run_dsl(backend, url: str, prog, args: list[dict], threads: int) -> dict:
    httpx.post(f"{url}/flush_cache", timeout=60)
    before = server_stats(url)
    t = time.perf_counter()
    states = prog.run_batch(args, backend=backend, num_threads=threads, temperature=0)
    secs = time.perf_counter() - t
    errors = [repr(s.error)[:200] for s in states if s.error is not None]
    out = _counts(url, before, len(args), secs) | {"errors": errors[:3], "failed": len(errors)}
    if prog is json_extract:  # the constrained output must parse and match the schema (48 tokens may cut it)
        out["invalid_json"] = sum(1 for s in states if s.error is None and not _valid_person(s["json"]))
    return out


def _valid_person(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


PLAIN_WORKLOADS = ("multi_turn_chat", "rag_shared_document")


class PlainClient:
    """The official OpenAI client against our /v1, one per server (a pool kept across runs, as the DSL's)."""

    def __init__(self, url: str):
        import openai

        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        self.model = self.client.models.list().data[0].id

    def close(self) -> None:
        self.client.close()


def run_openai_plain(plain: PlainClient, url: str, name: str, args: list[dict], threads: int) -> dict | None:
    """The chat workloads as plain client calls: each turn resends the whole conversation."""
    if name not in PLAIN_WORKLOADS:
        return None
    from concurrent.futures import ThreadPoolExecutor

    client, model = plain.client, plain.model

    def one(a):
        try:
            if name == "rag_shared_document":
                msgs = [
                    {"role": "system", "content": "Answer from the document.\n" + a["document"]},
                    {"role": "user", "content": a["question"]},
                ]
                client.chat.completions.create(model=model, messages=msgs, max_tokens=a["max_tokens"], temperature=0)
                return None
            msgs = [{"role": "system", "content": a["system"]}]
            for q in a["questions"]:
                msgs.append({"role": "user", "content": q})
                r = client.chat.completions.create(
                    model=model, messages=msgs, max_tokens=a["max_tokens"], temperature=0
                )
                msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        except Exception as e:  # noqa: BLE001 - reported like the DSL's failed programs
            return repr(e)[:200]
        return None

    httpx.post(f"{url}/flush_cache", timeout=60)
    before = server_stats(url)
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        errors = [e for e in pool.map(one, args) if e is not None]
    secs = time.perf_counter() - t
    return _counts(url, before, len(args), secs) | {"errors": errors[:3], "failed": len(errors)}


def warm_up(backend, plain: PlainClient | None, url: str, wl: dict, names: list[str], threads: int) -> None:
    """One small untimed run of every workload (and of its plain-client form)."""
    for n in names:
        prog, a = wl[n]
        few = a[:4]
        run_dsl(backend, url, prog, few, threads)
        if plain is not None:
            run_openai_plain(plain, url, n, few, threads)


def summarize(runs: list[dict]) -> dict:
    """The median of each measure over the runs, every run kept under "runs"."""
    out = dict(runs[0])
    for k in ("seconds", "programs_per_s", "cache_hit_rate"):
        out[k] = statistics.median(r[k] for r in runs)
    for k in ("prompt_tokens", "cached_tokens", "invalid_json"):
        if k in out:
            out[k] = statistics.median_low(r[k] for r in runs)
    out["errors"] = [e for r in runs for e in r["errors"]][:3]
    out["failed"] = max(r["failed"] for r in runs)
    out["repeats"] = len(runs)
    out["runs"] = runs
    return out


def _line(name: str, label: str, r: dict) -> str:
    runs = "" if r["repeats"] == 1 else " runs " + " ".join(f"{x['programs_per_s']:.2f}" for x in r["runs"])
    return (
        f"{name:>20} {label:>12}: {r['programs']:3d} programs {r['seconds']:7.2f} s {r['programs_per_s']:6.2f}/s "
        f"cache hit {r['cache_hit_rate']:.2f} failed {r['failed']}"
        + (f" invalid json {r['invalid_json']}" if "invalid_json" in r else "")
        + runs
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["workload"] for r in rows]
    on = [r["radix_on"]["programs_per_s"] for r in rows]
    off = [r["radix_off"]["programs_per_s"] for r in rows]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([i - 0.2 for i in x], on, 0.4, label="radix cache on")
    ax.bar([i + 0.2 for i in x], off, 0.4, label="--disable-radix-cache")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("programs / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (radix on); default: launch ours twice")
    ap.add_argument("--scale", type=int, default=4, help="programs per workload are multiples of this")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs per measurement (median reported, all kept); DSL and plain alternate",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument(
        "--server-args", default="", help="key=value server arguments for the launched servers, e.g. 'device=cuda'"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    wl = workloads(args.scale, args.seed)
    names = args.workloads or list(wl)
    extra = dict(kv.split("=", 1) for kv in args.server_args.split() if "=" in kv)
    rows = {n: {"workload": n} for n in names}
    for label, flags in (("radix_on", {}), ("radix_off", {"disable_radix_cache": True})):
        if args.url and label == "radix_off":
            break
        rt = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime(**flags, **extra)
        url = args.url or rt.url
        plain = None
        try:
            if label == "radix_on" and any(n in PLAIN_WORKLOADS for n in names):
                plain = PlainClient(url)
            warm_up(rt, plain, url, wl, names, args.threads)
            for n in names:
                prog, a = wl[n]
                dsl_runs, plain_runs = [], []
                for rep in range(args.repeats):
                    order = ("dsl", "plain") if rep % 2 == 0 else ("plain", "dsl")
                    for which in order:
                        if which == "dsl":
                            dsl_runs.append(run_dsl(rt, url, prog, a, args.threads))
                        elif plain is not None and n in PLAIN_WORKLOADS:
                            plain_runs.append(run_openai_plain(plain, url, n, a, args.threads))
                rows[n][label] = summarize(dsl_runs)
                print(_line(n, label, rows[n][label]), flush=True)
                if label == "radix_on":
                    rows[n]["openai_plain"] = summarize(plain_runs) if plain_runs else None
                    if plain_runs:
                        print(_line(n, "openai_plain", rows[n]["openai_plain"]), flush=True)
        finally:
            if plain is not None:
                plain.close()
            rt.shutdown()
    out = list(rows.values())
    print("\n| workload | cache on prog/s | hit rate | cache off prog/s | on/off | plain OpenAI prog/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in out:
        on, off, plain = r.get("radix_on"), r.get("radix_off"), r.get("openai_plain")
        print(
            f"| {r['workload']} | {on['programs_per_s']:.2f} | {on['cache_hit_rate']:.2f} | "
            f"{off['programs_per_s'] if off else float('nan'):.2f} | "
            f"{on['programs_per_s'] / off['programs_per_s'] if off else float('nan'):.2f}x | "
            f"{plain['programs_per_s'] if plain else float('nan'):.2f} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": platform.node(), "config": vars(args), "rows": out}, indent=2))
    if args.plot and all(r.get("radix_off") for r in out):
        plot(out, Path(args.plot))


if __name__ == "__main__":
    main()
