"""Serving benchmark against any OpenAI-compatible endpoint (ours, llama.cpp's, vLLM's, SGLang's).

Replays a dataset at a fixed request rate (Poisson arrivals) or as fast as a concurrency limit allows, streaming
every response, and reports request throughput, token throughput, TTFT, inter-token latency and end-to-end
latency (mean, p50, p90, p99) as JSON.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --dataset random \\
        --num-prompts 64 --input-len 256 --output-len 64 --max-concurrency 16 --out results/ours.json

Prompts are text built from a fixed word list, so every server tokenizes the same input itself. Output lengths
are fixed by banning the end-of-sequence token with `logit_bias` (a standard OpenAI field) rather than a
server-specific `ignore_eos`, so all servers are asked for the same work.

The client streams with aiohttp, as SGLang's and vLLM's serving benchmarks do: it costs about half of httpx's
CPU time per chunk, and a client busy parsing one stream's chunk delays every other stream's arrival time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: the client runs beside any server
from radixlm.srt.cpu_guard import CpuGuard  # noqa: E402
from radixlm.srt.utils import freeze_startup_objects  # noqa: E402

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain ocean forest city garden window table "
    "music story letter energy system market family school country question answer history science light "
    "stone bridge cloud winter summer morning evening dream voice color paper animal planet engine"
).split()


@dataclass
class RequestSpec:
    prompt: str
    output_len: int
    abort_after: int = 0  # >0: the client drops the stream after this many chunks (the server must free it)


@dataclass
class RequestResult:
    ok: bool = False
    aborted: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter at the start, then at each streamed chunk
    text: str = ""
    finish_reason: str | None = None  # None after a whole stream: the stream was cut (its end never came)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def make_dataset(args) -> list[RequestSpec]:
    specs = _make_specs(args, random.Random(args.seed))
    drop = random.Random(args.seed + 2)
    for spec in specs:
        if drop.random() < args.abort_fraction:
            spec.abort_after = drop.randint(1, max(1, spec.output_len // 2))
    return specs


def _make_specs(args, rng: random.Random) -> list[RequestSpec]:
    lo = lambda n: max(1, int(n * args.range_ratio))  # noqa: E731
    if args.dataset == "json":
        return [
            RequestSpec(
                f"Describe user {i} as a JSON record. Notes: "
                + words(rng, rng.randint(lo(args.input_len), args.input_len)),
                args.output_len,
            )
            for i in range(args.num_prompts)
        ]
    if args.dataset == "random":
        specs = [
            RequestSpec(
                words(rng, rng.randint(lo(args.input_len), args.input_len)),
                rng.randint(lo(args.output_len), args.output_len),
            )
            for _ in range(args.num_prompts)
        ]
        if args.output_lens_from:  # another run's answer lengths, in its order (an anchor with the same lengths)
            lens = json.loads(Path(args.output_lens_from).read_text())["output_lens"]
            for i, spec in enumerate(specs):
                spec.output_len = lens[i % len(lens)]
        return specs
    # shared-prefix: groups share a long system prompt, each request has its own question
    systems = [f"System {g}: " + words(rng, args.system_len) for g in range(args.groups)]
    specs = [
        RequestSpec(f"{systems[i % args.groups]}\nQuestion: {words(rng, args.input_len)}?\nAnswer:", args.output_len)
        for i in range(args.num_prompts)
    ]
    rng.shuffle(specs)
    return specs


JSON_SCHEMA = {  # the --dataset json workload: a record of the usual field kinds, every string bounded
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active", "role", "tags", "address"],
    "additionalProperties": False,
}


async def one_request(session: aiohttp.ClientSession, args, spec: RequestSpec) -> RequestResult:
    body = {
        "model": args.model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.no_stream:
        body["stream"] = False
        body.pop("stream_options")
    url = f"{args.base_url}/v1/completions"
    if args.dataset == "json":  # chat + response_format; the grammar ends the answer, so EOS stays allowed
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "record", "schema": JSON_SCHEMA}}
        url = f"{args.base_url}/v1/chat/completions"
    elif args.eos_token_id is not None:
        body["logit_bias"] = {str(args.eos_token_id): -100}
    res = RequestResult()
    start = last = time.perf_counter()
    res.times.append(start)
    chunks = 0
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            if args.no_stream:
                data = json.loads(await r.read())
                choice = data["choices"][0]
                res.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
                res.finish_reason = choice.get("finish_reason")
                res.prompt_tokens = data["usage"]["prompt_tokens"]
                res.output_tokens = data["usage"]["completion_tokens"]
                res.e2e = res.ttft = time.perf_counter() - start
                res.ok = True
                return res
            async for raw in r.content:  # one line at a time; SSE events end with a blank line
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(raw[6:])
                for c in data.get("choices") or []:
                    res.finish_reason = c.get("finish_reason") or res.finish_reason
                if data.get("usage"):
                    res.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                    res.output_tokens = data["usage"].get("completion_tokens", 0)
                piece = "".join(
                    c.get("text") or (c.get("delta") or {}).get("content") or "" for c in data.get("choices") or []
                )
                res.text += piece
                if piece:
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.times.append(now)
                    chunks += 1
                    if spec.abort_after and chunks >= spec.abort_after:
                        res.aborted = True
                        r.close()  # drops the connection mid-answer, as a client that hangs up does
                        return res
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = chunks > 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    """The requests' results and the run's duration."""
    width = args.max_concurrency or len(specs) or 1
    sem = asyncio.Semaphore(width)
    rng = random.Random(args.seed + 1)

    # read_bufsize: a line (one SSE event) may be long, e.g. a final chunk with usage or logprobs
    timeout = aiohttp.ClientTimeout(sock_connect=args.timeout, sock_read=args.timeout)  # per read, not per answer
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=width), read_bufsize=1 << 20
    ) as session:
        # The client timestamps every chunk: on a CPU that interrupts take time from (the lent GPU VMs' CPU 0
        # or 1 lost 10-40%), its own stalls would read as the server's inter-token latency.
        guard = CpuGuard("bench client")
        if not args.no_cpu_guard:
            guarding = asyncio.create_task(guard.run_in_loop())

        async def guarded(spec):
            async with sem:
                return await one_request(session, args, spec)

        await one_request(session, args, RequestSpec("warm up", 4))  # first-use costs belong to no measurement
        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(guarded(spec)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if not args.no_cpu_guard:
            guarding.cancel()
        args.client_cpu = guard.state()
        return results, duration


def wait_for_server(base_url: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as r:
                return [m["id"] for m in json.loads(r.read())["data"]]
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no OpenAI-compatible server answered at {base_url}")
        time.sleep(0.5)


def _valid_record(text: str) -> bool:
    """The answer is JSON that validates against JSON_SCHEMA (with jsonschema where installed, else the keys)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and set(value) == set(JSON_SCHEMA["required"])
    return jsonschema.Draft202012Validator(JSON_SCHEMA).is_valid(value)


def summarize(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))] * 1e3  # noqa: E731
    return {"mean": statistics.mean(v) * 1e3, "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--label", default=None, help="name of this row in the report")
    ap.add_argument(
        "--dataset",
        choices=("random", "shared-prefix", "json"),
        default="random",
        help="json: chat completions constrained by response_format (JSON_SCHEMA)",
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128, help="words per prompt (question, for shared-prefix)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="random lengths are in [ratio*len, len]")
    ap.add_argument(
        "--output-lens-from",
        default=None,
        help="random dataset: request i asks for the i-th answer length of this earlier --out JSON (with EOS "
        "banned, an unconstrained anchor whose answers end when another run's did)",
    )
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=512, help="words in each shared system prompt")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--eos-token-id", type=int, default=2, help="banned via logit_bias; -1 to allow EOS")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait", type=float, default=120, help="seconds to wait for the server to come up")
    ap.add_argument("--no-stream", action="store_true", help="whole answers instead of streams (no TTFT/ITL)")
    ap.add_argument(
        "--abort-fraction",
        type=float,
        default=0.0,
        help="share of requests whose client hangs up mid-stream (they count in no latency figure)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--no-cpu-guard",
        action="store_true",
        help="leave the client's loop wherever the kernel puts it (by default it moves off a CPU that "
        "loses over 3%% of its time to interrupts, softirqs or the hypervisor)",
    )
    ap.add_argument(
        "--save-chunk-times",
        action="store_true",
        help="keep each request's chunk arrival times (perf_counter) in the JSON, to line them up with "
        "a server step trace (RADIXLM_STEP_TRACE)",
    )
    args = ap.parse_args()
    if args.eos_token_id is not None and args.eos_token_id < 0:
        args.eos_token_id = None
    models = wait_for_server(args.base_url, args.wait)
    if args.model is None:
        args.model = models[0]
    specs = make_dataset(args)
    # The prompts live through the run: a collector pass over them mid-stream would show up as the server's ITL.
    freeze_startup_objects()
    results, duration = asyncio.run(run(args, specs))
    ok = [r for r in results if r.ok and not r.aborted]
    out_tokens = sum(r.output_tokens for r in ok)
    first_sent = min((r.times[0] for r in ok), default=0.0)
    report = {
        "label": args.label or args.base_url,
        "config": {k: v for k, v in vars(args).items() if k != "client_cpu"} | {"request_rate": str(args.request_rate)},
        "completed": len(ok),
        "aborted": sum(r.aborted for r in results),
        "valid_json": sum(_valid_record(r.text) for r in ok) if args.dataset == "json" else None,
        # answers whose end never came: no chunk (or body) carried a finish_reason
        "cut": sum(r.finish_reason is None for r in ok),
        "finish_reasons": {k: sum(r.finish_reason == k for r in ok) for k in {r.finish_reason for r in ok}},
        "invalid_examples": [r.text[:200] for r in ok if not _valid_record(r.text)][:3]
        if args.dataset == "json"
        else None,
        "failed": sum(not r.ok and not r.aborted for r in results),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.prompt_tokens for r in ok) / duration,
        "output_throughput": out_tokens / duration,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "itl_ms": summarize([x for r in ok for x in r.itl]),
        "e2e_ms": summarize([r.e2e for r in ok]),
        "mean_output_tokens": out_tokens / max(len(ok), 1),
        "mean_prompt_tokens": sum(r.prompt_tokens for r in ok) / max(len(ok), 1),
        "output_lens": [r.output_tokens for r in ok],  # in request order
        # per request, in request order: when it was sent (s after the first) and its TTFT, to tell a burst's
        # queue from the later arrivals' waits
        "sent_s": [round(r.times[0] - first_sent, 3) for r in ok],
        "ttft_by_request_ms": [round(r.ttft * 1e3, 1) for r in ok],
        "client_cpu": args.client_cpu,  # where the client's loop ran and any move off an interrupt-heavy CPU
    }
    per_request = ("config", "output_lens", "sent_s", "ttft_by_request_ms")
    print(json.dumps({k: v for k, v in report.items() if k not in per_request}, indent=2))
    if args.save_chunk_times:  # perf_counter is CLOCK_MONOTONIC: comparable with the server's step trace
        report["chunk_times"] = [r.times for r in ok]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
