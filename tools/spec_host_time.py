"""Investigation (issue 34): the host's share of a speculative verify step against a decode step. On a GPU a small
model's step is host work (the embedded model: a decode step 0.75-1.0 ms on an H100, a verify step 2.6x that), so
what a verify step adds on the host bounds its speed-up there. This runs the embedded model in-process (the
copy workload of bench_speculative.py, batch 1, overlap forced as on CUDA), times every scheduler step and, inside
it, the forward and the sampling (synchronous on a CPU), and prints per step kind the rest: the scheduler's own
Python. With --profile, a cProfile table of that rest (forward and sampling excluded).

    python tools/spec_host_time.py --output-len 160 [--profile] [--torch-profile 30] [--draft-tokens 8] [key=value]

Where the GGUF cannot travel (the GPU machine), the same step shapes with dummy weights and the benchmark's forced
acceptance (drafts = the plain run's answer, each token right with probability P):

    python tools/spec_host_time.py --model-path benchmarks/configs/smollm2-135m --forced-acceptance 0.9 \
        load_format=dummy tokenizer_path=TOK attention_backend=triton
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch  # noqa: E402
from bench_speculative import ForcedDrafter, force_verify, prompts  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from workloads import engine_kwargs  # noqa: E402

import radixlm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--torch-profile", type=int, default=0, help="print torch.profiler's top N ops (ngram run)")
    ap.add_argument("--draft-tokens", type=int, default=None)
    ap.add_argument("--model-path", default=None, help="default: the embedded model")
    ap.add_argument("--warm-runs", type=int, default=0, help="untimed runs of the measured one before it")
    ap.add_argument("--forced-acceptance", type=float, default=None, help="bench_speculative's forced workload")
    ap.add_argument("--steps", action="store_true", help="print the ngram run's steps in order: mode, tokens, output")
    ap.add_argument("engine_args", nargs="*", help="extra Engine keywords as key=value")
    args = ap.parse_args()
    kw = dict(log_level="warning", force_overlap_schedule=not args.no_overlap, **engine_kwargs(args.engine_args))
    spec = dict(speculative_algorithm="ngram")
    if args.draft_tokens:
        spec["speculative_num_draft_tokens"] = args.draft_tokens
    forced = args.forced_acceptance is not None
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": forced}
    answers: dict[tuple[int, ...], list[int]] = {}
    for name, extra in (("plain", {}), ("ngram", spec)):
        e = radixlm.Engine(args.model_path, **kw, **extra)
        sch, runner = e.scheduler, e.runner
        ids = prompts(e, "free" if forced else "copy", args.batch_size)
        e.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0})  # warm
        e.flush_cache()
        if forced and name == "ngram":  # drafts: the plain run's answers, spoiled token by token
            p_right = args.forced_acceptance
            sch.drafter = sch.outputs.drafter = sch.spec.drafter = ForcedDrafter(
                sch.drafter, answers, p_right, runner.vocab_size
            )
            force_verify(sch.outputs, sch.drafter)
        inner = defaultdict(float)
        for fn in ("run_forward", "sample"):
            orig = getattr(runner, fn)

            def timed(*a, _orig=orig, _fn=fn, **k):
                t = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    inner[_fn] += time.perf_counter() - t

            setattr(runner, fn, timed)
        orig_process = sch.outputs.process

        def timed_process(*a, **k):  # on a GPU: the wait for the step's tokens, then the host's accepting them
            t = time.perf_counter()
            try:
                return orig_process(*a, **k)
            finally:
                inner["process"] += time.perf_counter() - t

        sch.outputs.process = timed_process
        step, per_kind = sch.step, defaultdict(lambda: [0, 0.0, 0.0, 0.0])

        def traced():
            inner.clear()
            t = time.perf_counter()
            out = step()
            total = time.perf_counter() - t
            kind = sch.last_step.mode if sch.last_step else "?"
            k = per_kind[kind]
            k[0] += 1
            k[1] += total
            k[2] += total - inner["run_forward"] - inner["sample"]
            k[3] += inner["process"]
            if args.steps and name == "ngram" and sch.last_step is not None:
                r = next(iter(sch.running), None)
                seq.append((kind, sch.last_step.tokens, len(r.output_ids) if r is not None else -1))
            return out

        for _ in range(args.warm_runs):  # the verify steps' shapes compile here, not in the measured run
            e.generate(input_ids=ids, sampling_params=params)
            e.flush_cache()
        seq: list[tuple[str, int, int]] = []
        sch.step = traced
        prof = cProfile.Profile() if args.profile else None
        if prof:
            prof.enable()
        tprof = None
        if args.torch_profile and name == "ngram":
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            tprof = profile(activities=acts)
        with tprof or contextlib.nullcontext():
            t0 = time.perf_counter()
            outs = e.generate(input_ids=ids, sampling_params=params)
            wall = time.perf_counter() - t0
        if name == "plain":
            answers = {tuple(p): o["output_ids"] for p, o in zip(ids, outs)}
        if tprof is not None:
            avg = tprof.key_averages()
            print(avg.table(sort_by="cpu_time_total", row_limit=args.torch_profile, max_name_column_width=60))
            if torch.cuda.is_available():
                print(avg.table(sort_by="self_cuda_time_total", row_limit=args.torch_profile, max_name_column_width=60))
        if prof:
            prof.disable()
        toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"{name}: {toks} tokens in {wall:.2f} s ({toks / wall:.1f} tok/s)")
        for kind, (n, total, host, process) in sorted(per_kind.items()):
            print(f"  {kind:8s} steps {n:4d}  step {1e3 * total / n:7.2f} ms  host (no forward, no sampling) "
                  f"{1e3 * host / n:6.3f} ms  processing a step's tokens (on a GPU: waiting for them too) "
                  f"{1e3 * process / n:6.3f} ms")  # fmt: skip
        if seq:
            print("  steps (mode, tokens computed, output length):", " ".join(f"{m[0]}{t}:{o}" for m, t, o in seq))
        if prof:
            st = pstats.Stats(prof)
            st.sort_stats("tottime").print_stats(25)
            # the host's own Python by where it is spent (the forward's kernels sit under run_forward)
            hosts = "scheduler|speculative|sampl|batch|mem_cache|grammar|forward_batch"
            st.sort_stats("cumtime").print_stats(hosts, 40)
        e.shutdown()


if __name__ == "__main__":
    main()
