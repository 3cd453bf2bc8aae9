"""Speculative decoding (n-gram drafts) against plain decoding, in-process, batch by batch.

For each workload and batch size the same prompts run twice on one Engine configuration each: plain decoding
and `--speculative-algorithm ngram`, greedy, the same output length. Reported per row: output tok/s, the mean
time per output token of a request (its ITL), the speed-up, the drafts' acceptance rate and accepted length.
The cache is flushed before every run, so no answer is drafted from an earlier run's answer in the radix tree.
Each repeat runs plain, ngram, then plain again (`--no-control` drops the second): the paired ratio is the ngram
run over the mean of the plain runs either side of it, and the second plain run over the first is an A/A ratio,
the spread this host gives a ratio when nothing differs. Read a speed-up only beyond that spread.

Workloads (the embedded model, real weights, real acceptance):
  copy   each prompt gives a passage and asks for it back (a RAG answer quoting its document);
  free   open-ended questions (drafts come only from what the model repeats on its own).

    python benchmarks/bench_speculative.py --batch-sizes 1 8 32 \
        --out benchmarks/results/cpu-2core-avx2/speculative/spec.json --plot .../spec.png
    python benchmarks/bench_speculative.py ... speculative_max_batch_size=1024   # drafting at every size

  forced (with --forced-acceptance P) a synthetic copy task for any model, dummy weights included: the drafts
         are a plain run's answer, each token right with probability P, and the verify step takes the draft's
         tokens up to its first spoiled one as if the model had sampled them (random weights give near-flat
         logits, whose argmax a decode and a verify step need not share); EOS ignored. It measures what a
         verify step costs at a known acceptance, with the runtime's own draft-length policy.

    python benchmarks/bench_speculative.py --model-path benchmarks/configs/llama-3.1-8b --workloads forced \
        --forced-acceptance 0.7 --batch-sizes 1 8 32 128 load_format=dummy tokenizer_path=TOK

Extra `key=value` arguments go to both Engines (e.g. quantization=none).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import radixlm  # first: it sets OpenMP's passive wait before torch loads the runtime

# isort: split
import random
import statistics

from workloads import engine_kwargs

from radixlm.srt.speculative.drafter import Drafter

PASSAGES = [
    "The Amazon River flows through Peru, Colombia and Brazil. It carries more water than any other river, and "
    "its basin holds the largest rainforest on Earth.",
    "Copper is a soft, malleable metal with very high thermal and electrical conductivity. It is used in wires, "
    "pipes, coins and cooking pans.",
    "The lighthouse stood on a rock at the mouth of the bay. Every night its keeper climbed the stairs, lit the "
    "lamp and watched the ships pass.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes place in the "
    "chloroplasts of plant cells.",
    "Mount Everest is the highest mountain above sea level. It lies in the Himalayas on the border between "
    "Nepal and China.",
    "A binary search halves the range it looks at with every comparison, so it finds an item in a sorted list "
    "of a million entries in about twenty steps.",
    "The library opens at nine in the morning and closes at six in the evening. On Sundays it opens at noon.",
    "Honey bees live in colonies with one queen, thousands of workers and a few hundred drones. Workers gather "
    "nectar and pollen.",
]
QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "What are the benefits of regular exercise?",
    "Describe a busy market in the morning.",
    "How does a refrigerator work?",
    "Give advice to someone learning to cook.",
    "Why do leaves change colour in autumn?",
    "Describe your ideal weekend.",
]


def prompts(engine, workload: str, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        if workload == "copy":
            doc = " ".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(3))
            text = f"Document {i}: {doc}\nCopy the document above exactly."
        else:
            text = f"({i}) {QUESTIONS[i % len(QUESTIONS)]}"
        out.append(engine.chat_ids([{"role": "user", "content": text}]))
    return out


class ForcedDrafter(Drafter):
    """The `forced` workload's drafts (benchmark only): the plain run's answer to the same prompt, each token
    right with probability p, so the acceptance is known whatever the model says."""

    def __init__(self, base: Drafter, answers: dict[tuple[int, ...], list[int]], p: float, vocab: int):
        super().__init__(base.cfg, base.tree_cache, base.context_length)
        self.answers, self.p, self.vocab = answers, p, vocab
        self.rng = random.Random(0)
        self.right: dict[str, int] = {}  # rid -> leading draft tokens that are right (forced as sampled)

    def may_draft(self, reqs: list) -> bool:
        # the runtime's pre-look reads the request's own tokens, where a dummy model's answer matches nothing
        return any(tuple(r.input_ids) in self.answers for r in reqs)

    def _draft(self, r, room: int, floor: float) -> list[int]:
        answer = self.answers.get(tuple(r.input_ids))
        if answer is None:
            return []
        pos = len(r.output_ids)
        k = min(self.cfg.num_draft_tokens, r.max_new_tokens - pos - 1, room)
        draft = answer[pos : pos + max(k, 0)]
        right = next((i for i in range(len(draft)) if self.rng.random() >= self.p), len(draft))
        self.right[r.rid] = right
        return draft[:right] + [(t + 1) % self.vocab for t in draft[right : right + 1]] + draft[right + 1 :]


def force_verify(outputs, drafter: ForcedDrafter) -> None:
    """Make the verify step take each draft's right tokens as sampled (benchmark only; see `forced`)."""
    verify = outputs.__dict__.setdefault("_plain_verify", outputs._process_verify)  # wrapped once per Engine

    def forced(batch):
        sampled, extra = batch.pending.wait()
        row = 0
        for r, draft in zip(batch.reqs, batch.drafts):
            for j in range(min(drafter.right.get(r.rid, 0), len(draft))):
                sampled.next_ids[row + j] = draft[j]
            row += 1 + len(draft)
        batch.pending = SimpleNamespace(wait=lambda: (sampled, extra))
        return verify(batch)

    outputs._process_verify = forced


STEP_COUNTS = ("decode_steps", "spec_verify_steps", "spec_in_order_steps", "spec_looks_skipped", "spec_gate_closures")


def run(engine, ids: list[list[int]], output_len: int, ignore_eos: bool = False) -> dict:
    engine.flush_cache()
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": ignore_eos}
    before = [getattr(engine.scheduler.stats, k) for k in STEP_COUNTS]
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t0
    counts = {k: getattr(engine.scheduler.stats, k) - b for k, b in zip(STEP_COUNTS, before)}
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    drafted = sum(o["meta_info"].get("spec_draft_tokens", 0) for o in outs)
    accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    per_request = max(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "itl_ms": 1000 * wall / max(per_request, 1),
        "accept_rate": accepted / drafted if drafted else None,
        "accept_length": (accepted + steps) / steps if steps else None,
        "outputs": [o["output_ids"] for o in outs],
        "steps": counts,
    }


def control_range(controls: list[float]) -> str:
    if not controls:
        return ""
    return f"; plain over plain {statistics.median(controls):.2f}x, {min(controls):.2f}-{max(controls):.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--workloads", nargs="+", default=["copy", "free"], choices=("copy", "free", "forced"))
    ap.add_argument("--forced-acceptance", type=float, default=0.7, help="the forced workload's per-token p")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--draft-tokens", type=int, default=None, help="k; default the runtime's (8 on a GPU, 4 on a CPU)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row, plain and ngram in turn; the fastest is kept")
    ap.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run plain again after each ngram run: the ngram run is compared with the two plain runs' mean, and "
        "the second plain run over the first (nothing differs) says how much the host alone moves a ratio",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("engine_args", nargs="*", help="extra Engine keywords as key=value")
    args = ap.parse_args()
    extra = engine_kwargs(args.engine_args)
    common = dict(log_level="warning", **extra)
    rows = []
    engines = {
        "plain": radixlm.Engine(args.model_path, **common),
        "ngram": radixlm.Engine(
            args.model_path,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=args.draft_tokens,
            **common,
        ),
    }
    try:
        for e in engines.values():  # warm the kernels of both step shapes
            e.generate(input_ids=prompts(e, "copy", 2), sampling_params={"max_new_tokens": 16, "temperature": 0})
        for workload in args.workloads:
            for bs in args.batch_sizes:
                forced = workload == "forced"
                ids = prompts(engines["plain"], "free" if forced else workload, bs)
                if forced:  # the drafts are the plain answers, spoiled token by token
                    plain = run(engines["plain"], ids, args.output_len, ignore_eos=True)["outputs"]
                    sch = engines["ngram"].scheduler
                    answers = {tuple(p): o for p, o in zip(ids, plain)}
                    sch.drafter = sch.outputs.drafter = sch.spec.drafter = ForcedDrafter(
                        sch.drafter, answers, args.forced_acceptance, engines["ngram"].runner.vocab_size
                    )
                    force_verify(sch.outputs, sch.drafter)
                res, ratios, controls, ngram_steps = {}, [], [], []
                for _ in range(args.repeats):  # in turn, so that a slow spell of the host hits both alike
                    pair = {name: run(e, ids, args.output_len, ignore_eos=forced) for name, e in engines.items()}
                    before = pair["plain"]["tok_s"]
                    if args.control:  # plain again: the ngram run is compared with the plain runs either side
                        after = run(engines["plain"], ids, args.output_len, ignore_eos=forced)
                        controls.append(after["tok_s"] / before)
                        before = (before + after["tok_s"]) / 2
                        if after["wall_s"] < pair["plain"]["wall_s"]:
                            pair["plain"] = after
                    ratios.append(pair["ngram"]["tok_s"] / before)
                    ngram_steps.append(pair["ngram"]["steps"])
                    for name, r in pair.items():
                        if name not in res or r["wall_s"] < res[name]["wall_s"]:
                            res[name] = r
                same = res["plain"]["outputs"] == res["ngram"]["outputs"]
                row = {
                    "workload": workload,
                    "batch_size": bs,
                    "plain_tok_s": res["plain"]["tok_s"],
                    "ngram_tok_s": res["ngram"]["tok_s"],
                    "speedup": res["ngram"]["tok_s"] / res["plain"]["tok_s"],
                    # each repeat's ngram run over the plain run just before it: the host's slow spells hit
                    # a pair alike, so their median is steadier than the ratio of the two best runs
                    "speedup_median": statistics.median(ratios),
                    "speedup_pairs": ratios,
                    # --control: each repeat's second plain run over its first, the same work twice: how far
                    # this host moves a ratio when nothing differs (a speed-up inside that spread is not one)
                    "control_median": statistics.median(controls) if controls else None,
                    "control_pairs": controls,
                    "ngram_steps": ngram_steps,
                    "plain_itl_ms": res["plain"]["itl_ms"],
                    "ngram_itl_ms": res["ngram"]["itl_ms"],
                    "accept_rate": res["ngram"]["accept_rate"],
                    "accept_length": res["ngram"]["accept_length"],
                    "same_outputs": same,
                }
                rows.append(row)
                last = ngram_steps[-1]
                print(
                    f"{workload:5s} bs {bs:4d}: plain {row['plain_tok_s']:8.1f} tok/s, ngram "
                    f"{row['ngram_tok_s']:8.1f} ({row['speedup']:.2f}x; paired median {row['speedup_median']:.2f}x, "
                    f"{min(ratios):.2f}-{max(ratios):.2f}{control_range(controls)}); ITL {row['plain_itl_ms']:.1f} -> "
                    f"{row['ngram_itl_ms']:.1f} ms; accepted {row['accept_rate'] or 0:.2f}, "
                    f"{row['accept_length'] or 0:.2f} tok/verify; same outputs {same}; last ngram run: "
                    f"{last['decode_steps']} decode steps ({last['spec_verify_steps']} verify, "
                    f"{last['spec_in_order_steps']} in order), {last['spec_gate_closures']} gate closures",
                    flush=True,
                )
    finally:
        for e in engines.values():
            e.shutdown()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in vars(args).items() if k not in ("out", "plot")}
        meta = {"machine": platform.node(), "processor": platform.processor(), "config": cfg, "rows": rows}
        Path(args.out).write_text(json.dumps(meta, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for workload in args.workloads:
            pts = [(r["batch_size"], r["speedup"]) for r in rows if r["workload"] == workload]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=workload)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("n-gram / plain output tok/s")
        ax.legend()
        ax.set_title("Speculative decoding (n-gram drafts)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
