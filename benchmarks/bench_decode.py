"""Decode step time of the model runner: fixed batches at a fixed context, median over repeats.

A step is what the scheduler launches: the forward (a CUDA-graph replay where one is captured), greedy
sampling and the one device->host copy of the ids, from an idle device until the host holds the ids. On CUDA
each row also has the pipelined step (32 steps back to back, step k+1 launched before step k's ids are read,
as the overlap scheduler runs them), the host's launch time of one step (what the device waits for between
steps that do not overlap) and the step's anatomy on the device's clock. With --eager the same batch also runs
through the eager forward, for the graphs-vs-eager comparison in one process.

    python benchmarks/bench_decode.py --batch-sizes 1 16 --context 128
    python benchmarks/bench_decode.py --model-path benchmarks/configs/llama-3.1-8b --load-format dummy \
        --tokenizer-path TOK --attention-backend flashinfer --batch-sizes 1 32 128 --context 512 --eager \
        --out benchmarks/results/h100/decode_flashinfer.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import radixlm  # first: it sets OpenMP's passive wait before torch loads the runtime

# isort: split
import torch

from radixlm.srt.model_executor.synthetic import decode_spec, mixed_spec, release
from radixlm.srt.scheduler.batch import sampling_info


def _profile(served, plain, path: str, bs) -> None:
    """Kernel time by name for one served step (graph replay) and one eager forward (`plain`, unless None): where
    the step goes."""
    from torch.profiler import ProfilerActivity, profile

    runs = [("served step", served)] + ([("eager forward", plain)] if plain is not None else [])
    for _ in range(3):
        for _, fn in runs:
            fn()
    lines = []
    for name, fn in runs:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        lines += [f"== batch {bs}, {name}, 5 runs", prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)]
        if name == "served step":
            trace = Path(path).with_suffix(f".bs{bs}.trace.json")
            prof.export_chrome_trace(str(trace))
            lines += timeline(json.loads(trace.read_text()), steps=5)
            trace.unlink()
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def timeline(trace: dict, steps: int) -> list[str]:
    """One served step's device timeline from a profiler trace of `steps` equal steps: kernel time by kernel,
    and the idle time (or, under programmatic dependent launch, the overlap) before each kernel, by kernel."""
    ks = sorted(
        (e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    if not ks or len(ks) % steps:
        return [f"timeline: {len(ks)} kernels do not split into {steps} equal steps"]
    per = len(ks) // steps
    step = ks[per * (steps - 1) :]  # the last step: the earlier ones warm up the profiler
    span = step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]
    busy: dict[str, list[float]] = {}
    idle: dict[str, float] = {}
    for prev, k in zip([None] + step[:-1], step):
        grid = k.get("args", {}).get("grid")  # tells the projections of one GEMV kernel apart
        name = k["name"].split("<")[0][:44] + (f" {grid}" if grid else "")
        busy.setdefault(name, []).append(k["dur"])
        if prev is not None:
            idle[name] = idle.get(name, 0.0) + k["ts"] - (prev["ts"] + prev["dur"])
    total_busy = sum(sum(v) for v in busy.values())
    out = [
        f"timeline of one step: {per} kernels, span {span:.1f} us, kernel time {total_busy:.1f} us, "
        f"idle {span - total_busy:.1f} us (negative: kernels overlapped)",
        f"{'kernel':60s} {'count':>5s} {'mean us':>8s} {'total us':>9s} {'idle before, us':>15s}",
    ]
    for name, durs in sorted(busy.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"{name:60s} {len(durs):5d} {sum(durs) / len(durs):8.2f} {sum(durs):9.1f} {idle.get(name, 0):15.1f}")
    return out


def collective_share(served, steps: int = 5) -> tuple[float, float]:
    """Tensor parallelism: (microseconds of NCCL kernels per step, their share of the step's device span) on this
    rank, from a profile of `steps` served steps. A collective's kernel also waits there for the slowest rank:
    the time is what the step spends in communication, skew included."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        served()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            served()
        torch.cuda.synchronize()
    ks = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not ks:
        return 0.0, 0.0
    nccl = sum(e.device_time for e in ks if "nccl" in e.name.lower())
    span = max(e.time_range.end for e in ks) - min(e.time_range.start for e in ks)
    return nccl / steps, nccl / span if span else 0.0


def step_times(engine, bs: int, ctx: int, repeats: int, eager: bool, profile: str | None = None) -> dict:
    r = engine.runner
    sharded = r.tp.size > 1  # rank 0's runner: its forwards are announced to the other ranks, its own calls not
    spec, slots, rows = decode_spec(r, bs, ctx)
    sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda: None)

    class _Req:  # the sampling view of a greedy request
        sampling_params = radixlm.SamplingParams(temperature=0)
        return_logprob, top_logprobs_num, output_ids, stop_token_ids, seed = False, 0, [], frozenset(), 0

        def produced(self) -> int:
            return 0

    info = sampling_info([_Req()] * bs, r.vocab_size, r.device)

    def served():
        return r.sample(r.run_forward(spec), info).wait()[0].next_ids

    def plain():
        return r.forward(spec.build(r.device, None)).argmax(-1).tolist()

    def pipelined():
        """Steps as the overlap scheduler runs them: step k+1 is launched before step k's ids are read."""
        prev = None
        for _ in range(_PIPELINE_STEPS):
            cur = r.sample(r.run_forward(spec), info)
            if prev is not None:
                prev.wait()
            prev = cur
        return prev.wait()

    def launch():
        """Host time from the start of a step until its forward (a graph replay: how much of that is the replay
        alone, i.e. the graph launches, plus for FlashInfer the input kernel and the plan) and its sampling are
        launched: the device waits this long when steps do not overlap. Also when, on the device's clock, the
        forward and the sampling end, and when the host has the ids."""
        g = r.graphs.decode if r.graphs is not None else None
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        t0 = time.perf_counter()
        logits = r.run_forward(spec)
        t1 = time.perf_counter()
        marks[1].record()
        pending = r.sample(logits, info)
        t2 = time.perf_counter()
        marks[2].record()
        pending.wait()
        wall = time.perf_counter() - t0
        marks[2].synchronize()  # recorded after the ids' copy event
        # The device's clock: from the step's start to the forward's end and the sampling's end (the first
        # mark is taken as the host starts the step, the device being idle then)
        device = [marks[0].elapsed_time(marks[i]) / 1e3 for i in (1, 2)]
        replay = 0.0
        if g is not None and bs <= g.max_size and not sharded:  # a bare replay would wait for the other ranks
            t3 = time.perf_counter()
            g.relaunch(bs)
            replay = time.perf_counter() - t3
            sync()
        return t1 - t0, t2 - t1, replay, device[0], device[1], wall

    if profile:
        _profile(served, None if sharded else plain, profile, bs)
    timed = [("step", served)] + ([("eager", plain)] if eager else [])
    out = {name: _median_s(fn, repeats, sync) for name, fn in timed}
    if r.device.type == "cuda":
        out["pipelined"] = _median_s(pipelined, max(3, repeats // 4), sync) / _PIPELINE_STEPS
        parts = [launch() for _ in range(repeats)]
        out["launch"] = statistics.median(p[0] + p[1] for p in parts)
        out["launch_parts"] = [statistics.median(p[i] for p in parts) for i in range(6)]
        if sharded:
            out["collective_us"], out["collective_share"] = collective_share(served)
    release(r, slots, rows)
    return out


_PIPELINE_STEPS = 32


def _median_s(fn, repeats: int, sync, settle=None) -> float:
    """Median seconds of `fn`, each call starting on an idle device. A step is over when the host holds its
    ids, as the scheduler goes on then: the step functions return those, so no device-wide synchronize (a
    driver call of 15-70 us on these hosts) is timed after them; `settle` is for functions that return before
    their device work is done."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        if settle is not None:
            settle()
        times.append(time.perf_counter() - t)
    sync()
    return statistics.median(times)


def mixed_times(engine, decode_bs: int, prefill: int, ctx: int, repeats: int, profile: str | None = None) -> dict:
    """One mixed step (`mixed_spec`) through the runner's graphs (whole or piecewise, where they fit) and eager."""
    r = engine.runner
    spec, slots, rows = mixed_spec(r, decode_bs, ctx, prefill)
    sync = torch.cuda.synchronize if r.device.type == "cuda" else (lambda: None)
    runs = {"graphs": lambda: r.run_forward(spec), "eager": lambda: r.forward(spec.build(r.device, None))}
    out = {name: _median_s(run, repeats, sync, sync) for name, run in runs.items()}
    # The host's part alone: until the launch returns (the device may still be running it).
    out["graphs_launch"] = _median_s(runs["graphs"], repeats, sync)
    if profile and r.device.type == "cuda":
        _profile(runs["graphs"], runs["eager"], profile, f"mixed{decode_bs}+{prefill}")
    release(r, slots, rows)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--fp8-lm-head", action="store_true", help="with --quantization fp8: the LM head in fp8 too")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8_e4m3"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one per GPU)")
    ap.add_argument(
        "--disable-custom-all-reduce", action="store_true", help="tp > 1: NCCL all-reduces, no fused all-reduce + norm"
    )
    ap.add_argument("--extend-cuda-graph", default="auto", choices=["auto", "whole", "piecewise", "off"])
    ap.add_argument("--eager", action="store_true", help="also time the eager forward of the same batch")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--mixed",
        nargs="*",
        default=[],
        metavar="DECODES:PROMPT",
        help="also time mixed steps, e.g. 32:512 (32 decodes + one 512-token prompt), graphs vs eager",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="append a kernel-time table per batch size to this file (CUDA)")
    args = ap.parse_args()
    if args.tp_size > 1 and (args.eager or args.mixed):
        ap.error("--eager and --mixed call rank 0's forward alone: not with --tp-size > 1")
    max_bs = max(args.batch_sizes)
    mixed = [tuple(int(v) for v in m.split(":")) for m in args.mixed]
    tokens = max([max_bs * (args.context + 1)] + [d * (args.context + 1) + p for d, p in mixed]) + 64
    engine = radixlm.Engine(
        args.model_path,
        tokenizer_path=args.tokenizer_path,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        fp8_lm_head=args.fp8_lm_head,
        kv_cache_dtype=args.kv_cache_dtype,
        log_level="warning",
        attention_backend=args.attention_backend,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=max_bs,
        extend_cuda_graph=args.extend_cuda_graph,
        max_total_tokens=tokens,
        max_running_requests=max([max_bs, *(d + 1 for d, _ in mixed)]),
        tp_size=args.tp_size,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
    )
    r = engine.runner
    tuner = r.kernel_ops.tuner
    for line in getattr(tuner, "report", []):
        print("skinny matmul:", line, flush=True)
    rows = []
    graphs = r.uses_cuda_graphs
    for bs in args.batch_sizes:
        t = step_times(engine, bs, args.context, args.repeats, args.eager, args.profile)
        row = {
            "batch": bs,
            "context": args.context,
            "backend": r.attn_backend_name,
            "kernels": r.kernel_ops.name,
            "cuda_graph": graphs,
            "tp_size": args.tp_size,
            "custom_all_reduce": args.tp_size > 1 and not args.disable_custom_all_reduce,
            "step_ms": t["step"] * 1e3,
            "tokens_per_s": bs / t["step"],
        }
        if "collective_us" in t:
            row.update(collective_us=t["collective_us"], collective_share=t["collective_share"])
        if "eager" in t:
            row.update(eager_forward_ms=t["eager"] * 1e3, eager_tokens_per_s=bs / t["eager"])
        if "pipelined" in t:
            fwd, smp, replay, dev_fwd, dev_smp, wall = t["launch_parts"]
            row.update(
                pipelined_step_ms=t["pipelined"] * 1e3,
                pipelined_tokens_per_s=bs / t["pipelined"],
                host_launch_ms=t["launch"] * 1e3,
                host_forward_ms=fwd * 1e3,
                host_sample_ms=smp * 1e3,
                graph_launch_ms=replay * 1e3,
                step_forward_end_ms=dev_fwd * 1e3,
                step_sample_end_ms=dev_smp * 1e3,
                step_wall_ms=wall * 1e3,
            )
        rows.append(row)
        extra = f"   eager forward {t['eager'] * 1e3:8.2f} ms" if "eager" in t else ""
        if "collective_us" in t:
            extra += f"   NCCL {t['collective_us']:7.1f} us/step ({t['collective_share']:.0%})"
        if "pipelined" in t:
            extra += (
                f"   pipelined {t['pipelined'] * 1e3:6.2f} ms   host launch {t['launch'] * 1e3:5.3f} ms "
                f"(forward {fwd * 1e3:5.3f}, of which the replay {replay * 1e3:5.3f}; sampling "
                f"{smp * 1e3:5.3f})   device: forward ends {dev_fwd * 1e3:6.3f}, sampling "
                f"{dev_smp * 1e3:6.3f}, host has ids {wall * 1e3:6.3f} ms"
            )
        print(
            f"{r.attn_backend_name:>12} graph={graphs!s:5} batch {bs:4d}: {t['step'] * 1e3:8.2f} ms/step "
            f"{bs / t['step']:9.1f} tokens/s{extra}",
            flush=True,
        )
    mixed_rows = []
    for d, p in mixed:
        t = mixed_times(engine, d, p, args.context, args.repeats, args.profile)
        g = r.graphs
        kind = (
            "whole"
            if g is not None and g.whole is not None
            else "piecewise"
            if g is not None and g.piecewise is not None
            else "none"
        )
        mixed_rows.append(
            {
                "decodes": d,
                "prompt": p,
                "context": args.context,
                "graphs": kind,
                "graphs_ms": t["graphs"] * 1e3,
                "graphs_host_launch_ms": t["graphs_launch"] * 1e3,
                "eager_ms": t["eager"] * 1e3,
            }
        )
        print(
            f"{r.attn_backend_name:>12} mixed {d} decodes + {p}-token prompt: {t['graphs'] * 1e3:8.2f} ms "
            f"({kind} graphs; host launch {t['graphs_launch'] * 1e3:6.2f} ms), eager {t['eager'] * 1e3:8.2f} ms",
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        dev = torch.cuda.get_device_name(r.device) if r.device.type == "cuda" else platform.processor()
        Path(args.out).write_text(
            json.dumps(
                {
                    "device": dev,
                    "dtype": str(r.dtype),
                    "model": args.model_path,
                    "skinny_matmul": getattr(tuner, "report", []),
                    "rows": rows,
                    "mixed": mixed_rows,
                },
                indent=2,
            )
        )
    engine.shutdown()


if __name__ == "__main__":
    main()
