"""One `ServerArgs` dataclass holds every knob; the CLI is generated from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field

from radixlm.srt.choices import ATTENTION_BACKENDS, QUANTIZATION_METHODS


def _opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = _opt(None, "HF directory, .gguf file, or empty for the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _opt(None, "tokenizer directory (default: the model's)")
    served_model_name: str | None = _opt(None, "name reported by /v1/models (default: derived from the model path)")
    dtype: str = _opt("auto", "weight and activation dtype", ("auto", "float32", "float16", "bfloat16"))
    load_format: str = _opt(
        "auto", "auto: read the checkpoint; dummy: random weights from config.json (benchmarks)", ("auto", "dummy")
    )
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto")
    quantization: str = _opt(
        "auto",
        "auto: gguf for a GGUF file with Q4 linears on a CPU our Q4 kernel runs on "
        "(AVX-512 BF16, or AVX2 with FMA and F16C), fp8 for an FP8 checkpoint on a GPU with FP8 "
        "tensor cores, else none; none: weights dequantized to --dtype; gguf: keep a GGUF file's "
        "Q4_0/Q4_1 linear weights 4-bit in memory (our kernel, else torch's int4 op; CPU only); fp8: "
        "every projection in e4m3, per-channel weight and per-token activation scales (quantized "
        "at load from bf16 or random weights, or read from an FP8 checkpoint; CUDA, compute 8.9+)",
        QUANTIZATION_METHODS,
    )
    fp8_lm_head: bool = _opt(False, "with --quantization fp8, the LM head in FP8 too (by default it stays bf16)")
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache element type. auto: the model's dtype; bf16: bfloat16 (a bfloat16 model); fp8_e4m3: half "
        "the bytes per token (twice the tokens in the same memory), with per-layer K and V scales measured "
        "by a calibration forward at start-up (CUDA, compute 8.9+; triton or torch_native attention)",
        ("auto", "bf16", "fp8_e4m3"),
    )
    context_length: int | None = _opt(None, "override the model's maximum context length")
    # Tensor parallelism
    tp_size: int = _opt(1, "tensor-parallel ranks: one process per GPU (or N CPU processes with gloo)")
    dist_init_addr: str | None = _opt(None, "host:port where the ranks meet (default: a free local port)")
    disable_custom_all_reduce: bool = _opt(
        False,
        "NCCL for every all-reduce on one host's GPUs: no fused all-reduce + norm kernel over symmetric memory",
    )
    dist_timeout: float = _opt(60.0, "seconds the ranks may take to meet before start-up fails with a message")
    tp_check_batches: bool = _opt(
        False, "debug: every rank hashes the batch it is about to run; a difference stops the server with an error"
    )
    nnodes: int = _opt(1, "hosts the tp_size ranks span (tp_size / nnodes ranks on each)")
    node_rank: int = _opt(0, "this host's index: node 0 serves HTTP and schedules, the others run ranks only")
    # Data parallelism
    dp_size: int = _opt(1, "replicas of the model on this host behind one router (radixlm router) on --port")
    router_policy: str = _opt(
        "cache_aware",
        "with --dp-size: how the router picks a replica",
        ("cache_aware", "round_robin", "least_load", "random"),
    )
    random_seed: int = _opt(0, "seed for anything not seeded per request")
    # HTTP
    host: str = _opt("127.0.0.1", "HTTP host")
    port: int = _opt(30000, "HTTP port")
    api_key: str | None = _opt(None, "require this bearer key on every route but /health")
    max_queued_requests: int | None = _opt(
        None, "answer 503 while this many requests are in flight (default: no limit)"
    )
    max_request_body_mb: float = _opt(8.0, "largest accepted HTTP request body, in MiB (larger: 413)")
    log_level: str = _opt("info", "logging level", ("debug", "info", "warning", "error"))
    # Memory and scheduling
    mem_fraction_static: float | None = _opt(None, "GPU: fraction of device memory for weights + KV cache")
    max_total_tokens: int | None = _opt(None, "KV cache size in tokens (default: from memory)")
    max_running_requests: int | None = _opt(None, "most requests decoding at once")
    max_prefill_tokens: int = _opt(16384, "most new prompt tokens in one extend batch")
    chunked_prefill_size: int | None = _opt(
        None, "split prompts into chunks of this many tokens (default 8192 GPU, 1024 CPU; -1 off)"
    )
    schedule_policy: str = _opt("lpm", "waiting-queue order", ("lpm", "dfs-weight", "fcfs", "lof", "random"))
    schedule_conservativeness: float = _opt(1.0, "scale of the decode-growth reserve at admission")
    disable_radix_cache: bool = _opt(False, "no prefix sharing across requests")
    stream_interval: int = _opt(1, "send streamed output every N tokens")
    # Backends
    attention_backend: str = _opt(
        "auto",
        "attention kernels (auto: flashinfer on CUDA when installed, else triton on CUDA, else torch_native)",
        ("auto", *ATTENTION_BACKENDS),
    )
    flashinfer_prefill_backend: str = _opt(
        "fa2",
        "FlashInfer prefill kernels: fa2 shares one JIT module with "
        "decode (one compile at first start); fa3 (Hopper) or auto add a "
        "second",
        ("fa2", "fa3", "auto"),
    )
    disable_cuda_graph: bool = _opt(False, "run every batch eagerly: no CUDA graphs at all")
    cuda_graph_max_bs: int | None = _opt(
        None,
        "largest decode batch captured in a CUDA graph (default: 256 on "
        "GPUs of 60 GB or more, 160 from 30 GB, else 64)",
    )
    extend_cuda_graph: str = _opt(
        "auto",
        "CUDA graphs for prefill and mixed batches: whole (attention inside; "
        "backends whose extend attention needs no host plan: triton), piecewise "
        "(attention eager between graphs; any backend), auto (whole where the backend "
        "can, piecewise for the batches whole graphs have no room for), off",
        ("auto", "whole", "piecewise", "off"),
    )
    extend_cuda_graph_max_tokens: int = _opt(
        4096, "largest prefill/mixed batch (tokens) run through extend CUDA graphs; larger ones run eagerly"
    )
    disable_overlap_schedule: bool = _opt(
        False, "schedule the next step only after the current one's tokens are back on the host"
    )
    force_overlap_schedule: bool = _opt(
        False,
        "overlap scheduling on a CPU device too (it runs on CUDA only "
        "by default, where the forward is asynchronous); for tests",
    )
    enable_mixed_chunk: bool = _opt(
        False,
        "let running requests decode in the same batch as a prefill chunk (the default on CUDA; on a CPU, see "
        "--decode-prefill-budget)",
    )
    disable_mixed_chunk: bool = _opt(
        False,
        "CUDA: running requests wait while prompt chunks prefill (lower ITL tail, higher TTFT under bursts)",
    )
    decode_prefill_budget: int | None = _opt(
        None,
        "while requests are decoding, the most prompt tokens one step "
        "takes on, the decodes riding along in the same batch, so that no "
        "stream waits for a whole prompt's prefill (default off; -1 "
        "off; meant for CPUs, where one prompt's prefill is many decode "
        "steps long)",
    )
    scheduler_cpus: str = _opt(
        "auto",
        "CPUs the scheduler loop runs on: auto (on CUDA, it and the detokenizer's "
        "and HTTP server's loops move off a CPU that loses over 3%% of its time to "
        "interrupts, softirqs or the hypervisor, checked every 2 s), none (the kernel "
        "places them), or a list such as 2-7,9 (the scheduler pinned there)",
    )
    speculative_algorithm: str | None = _opt(
        None,
        "speculative decoding: ngram drafts the next tokens from the request's own prompt and output (prompt "
        "lookup) and from continuations already in the radix cache, and verifies them in one forward; the "
        "output is exactly what plain decoding gives (greedy and sampled)",
        (None, "ngram"),
    )
    speculative_num_draft_tokens: int | None = _opt(
        None, "most tokens drafted for a request per step (k); default 8 on a GPU, 4 on a CPU"
    )
    speculative_ngram_min: int = _opt(2, "shortest n-gram of the sequence's tail looked up for a draft")
    speculative_ngram_max: int = _opt(4, "longest n-gram looked up (the longest match wins)")
    speculative_max_batch_size: int | None = _opt(
        None,
        "draft only while at most this many requests decode (default: measured; nobody drafts at batch sizes "
        "where steps with drafting delivered fewer tokens per second than steps without, re-probed now and then)",
    )
    speculative_max_verify_tokens: int | None = _opt(
        None,
        "most tokens one verify step computes (each drafting request's last token and its draft): drafts are "
        "cut to fit, so a large batch drafts few tokens a request; default 256 on a GPU (about where a step's "
        "matmuls turn from reading weights to computing), no limit on a CPU",
    )
    grammar_backend: str = _opt(
        "auto",
        "constrained decoding backend: auto picks, per request, the first of "
        "llguidance, xgrammar, outlines that enforces every keyword of its grammar",
        ("auto", "llguidance", "xgrammar", "outlines", "none"),
    )
    disable_grammar_promotion: bool = _opt(
        False,
        "with --grammar-backend auto, keep a JSON schema asked for again on llguidance instead of moving its later "
        "requests to outlines once outlines has built its index in the background (cheaper masks per step; same "
        "language, though greedy answers may pick other tokens)",
    )
    grammar_compile_timeout: float = _opt(
        30.0,
        "seconds a grammar may take to compile, from when a worker starts "
        "it, before its request fails with a 400 (queued requests fail with a "
        "503 only if no worker comes free for this long)",
    )
    jump_forward: str = _opt(
        "auto",
        "append text a grammar forces in one extend instead of sampling it token by "
        "token: on, off, or auto (on without overlap scheduling; off with it, the default on "
        "CUDA, where every jump costs the request an extend step, which halved JSON-schema "
        "throughput at 64 concurrent requests)",
        ("auto", "on", "off"),
    )

    def __post_init__(self) -> None:
        if self.decode_prefill_budget is not None and self.decode_prefill_budget == 0:
            raise ValueError("decode_prefill_budget must be positive, or -1 for off")
        for name in (
            "max_total_tokens",
            "max_running_requests",
            "max_queued_requests",
            "cuda_graph_max_bs",
            "extend_cuda_graph_max_tokens",
            "speculative_num_draft_tokens",
            "speculative_max_batch_size",
            "speculative_max_verify_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {self.tp_size}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be positive, got {self.dist_timeout}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, got {self.dp_size}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError("dp_size > 1 starts its replicas on this host: use one node (nnodes 1)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes} (ranks per host)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("nnodes > 1 needs --dist-init-addr host:port (node 0's address, reachable by all)")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout}")
        if self.max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        if self.fp8_lm_head and self.quantization not in ("fp8", "auto"):
            raise ValueError(f"fp8_lm_head needs --quantization fp8, not {self.quantization}")
        if self.stream_interval <= 0:
            raise ValueError(f"stream_interval must be positive, got {self.stream_interval}")
        if self.enable_mixed_chunk and self.disable_mixed_chunk:
            raise ValueError("--enable-mixed-chunk and --disable-mixed-chunk contradict each other: give one")
        if self.scheduler_cpus not in ("auto", "none"):
            from radixlm.srt.cpu_guard import cpu_list

            try:
                cpus = cpu_list(self.scheduler_cpus)
            except ValueError:
                raise ValueError(
                    f"scheduler_cpus must be auto, none or a CPU list such as 2-7,9, got {self.scheduler_cpus!r}"
                ) from None
            if not cpus <= os.sched_getaffinity(0):
                raise ValueError(
                    f"scheduler_cpus {self.scheduler_cpus!r} names CPUs this process may not use "
                    f"(allowed: {sorted(os.sched_getaffinity(0))})"
                )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "speculative n-gram sizes must satisfy 1 <= min <= max, got "
                f"{self.speculative_ngram_min}..{self.speculative_ngram_max}"
            )
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")

    def mixed_chunks(self, device_type: str) -> bool:
        """Whether running requests decode inside prompt chunks: asked for, or on CUDA unless turned off. On CUDA a
        prompt chunk is compute-bound and the decode rows ride along almost free; with them waiting instead,
        requests that arrive together finish together and the next burst queues behind one another's prefill
        (benchmarks/results/README.md, 1,000 in / 1,000 out at 64 users: TTFT p50 4.7 s waiting, 3.2 s riding)."""
        return self.enable_mixed_chunk or (device_type == "cuda" and not self.disable_mixed_chunk)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            meta = f.metadata
            if kind is bool:
                parser.add_argument(flag, action="store_true", default=f.default, help=meta.get("help"))
                continue
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            parser.add_argument(flag, type=base, default=f.default, choices=meta.get("choices"), help=meta.get("help"))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{name: getattr(args, name) for name in cls.field_names()})
