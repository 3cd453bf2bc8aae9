"""Owns the model, the KV memory pools, the attention backend, the decode CUDA graphs and the sampler; runs one
batch at a time. `run_forward` launches a batch's forward (a graph replay where one fits) and `sample`
launches its sampling and the one device->host copy of the results; neither waits for the device."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from radixlm.srt.cpu_threads import configure_cpu_forward
from radixlm.srt.layers.attention import create_backend, resolve_backend
from radixlm.srt.layers.ops import select_kernel_ops, tune_skinny_linears
from radixlm.srt.layers.sampler import SampleOutput, Sampler, SamplingBatchInfo, unpack_sample
from radixlm.srt.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardBatch, ForwardMode
from radixlm.srt.model_executor.graph_runner import GraphRunner, default_cuda_graph_max_bs
from radixlm.srt.model_executor.host_transfer import HostStaging, PendingCopy
from radixlm.srt.model_executor.kv_dtype import calibrate_kv_scales, resolve_kv_dtype
from radixlm.srt.model_loader.loader import LoadedModel

if TYPE_CHECKING:
    from radixlm.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_CPU_KV_MEMORY_FRACTION = 0.2  # of MemAvailable
_CPU_MAX_KV_TOKENS = 65536
_CPU_KV_CONTEXTS = 2  # a CPU pool holds two full-length requests by default (decode there is slow past that)
_DEFAULT_GPU_MEM_FRACTION = 0.85


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class StepHook(Protocol):
    """Told of every step this runner runs for the scheduler (tensor parallelism: rank 0 announces the step to
    the other ranks, which run the same forward; see distributed/ranks.py StepSender)."""

    def before_forward(self, spec: BatchSpec) -> None: ...

    def on_futures(self, ids: torch.Tensor) -> None: ...


@dataclass
class PendingSample:
    """A step's sampled ids on the device (for the next step's inputs) and their copy on its way to the host."""

    ids: torch.Tensor
    n: int
    info: SamplingBatchInfo | None
    copy: PendingCopy
    extra: int  # trailing float64 values after the [n, cols] block (prompt logprobs)

    def wait(self) -> tuple[SampleOutput | None, list[float]]:
        flat = self.copy.wait()
        out = unpack_sample(flat, self.n, self.info) if self.n else None
        return out, (flat[flat.numel() - self.extra :].tolist() if self.extra else [])


class ModelRunner:
    def __init__(self, loaded: LoadedModel, args: ServerArgs):
        self.model = loaded.model
        self.tp = self.model.tp
        self.rank_reports: list[dict] = []  # every rank's place and memory (distributed/ranks.py rank_report)
        # This rank's shapes (its heads and MLP columns under tensor parallelism; the model's otherwise), with the
        # fields the loader filled in after building the model (end-of-sequence ids).
        local = self.model.local_config
        self.config = dataclasses.replace(
            loaded.config,
            num_heads=local.num_heads,
            num_kv_heads=local.num_kv_heads,
            intermediate_size=local.intermediate_size,
        )
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.context_length = self.config.context_length
        self.server_args = args
        self.vocab_size = self.config.vocab_size
        self.attn_backend_name = resolve_backend(
            args.attention_backend, self.device.type, self.config.head_dim, self.dtype, args.kv_cache_dtype
        )
        self.kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, self.dtype, self.device, self.attn_backend_name)
        bytes_per_token = self.config.kv_bytes_per_token * torch.tensor([], dtype=self.kv_dtype).element_size()
        self.max_total_tokens = args.max_total_tokens or self._default_kv_tokens(bytes_per_token, args)
        # every rank's pool must hold the slots rank 0 hands out
        self.max_total_tokens = self.tp.all_reduce_min(self.max_total_tokens)
        if self.max_total_tokens < 16:
            raise ValueError(f"KV cache of {self.max_total_tokens} tokens is too small")
        default_running = 128 if self.device.type == "cpu" else 1024
        self.max_running_requests = args.max_running_requests or min(default_running, self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_length + 1, self.device)
        self.token_to_kv_pool = TokenToKVPool(
            self.max_total_tokens,
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.kv_dtype,
            self.device,
        )
        self.attn_backend = create_backend(self.attn_backend_name, self)
        self.kernel_ops = select_kernel_ops("auto", self.device)
        self.model.set_kernel_ops(self.kernel_ops)
        # On CPU the layers run as one flat loop (per-op overhead is most of a small model's step there); it
        # stores K and V itself, in the model's dtype.
        self.cpu_path = self.device.type == "cpu" and not self.token_to_kv_pool.is_fp8 and self.model.enable_cpu_path()
        if self.token_to_kv_pool.is_fp8:
            calibrate_kv_scales(self)
        self.sampler = Sampler(self.vocab_size, self.device)
        self.staging = HostStaging(self.device)
        # Sampled ids that later steps read before the host has seen them (overlap scheduling).
        self.future_map = torch.zeros(4 * self.max_running_requests + 64, dtype=torch.int64, device=self.device)
        self._future_next = 0
        self.step_hook: StepHook | None = None
        if self.device.type == "cpu":
            logger.info("CPU forward: %s", configure_cpu_forward(args.tp_size // args.nnodes))  # ranks on this host
        if self.cpu_path:
            from radixlm.kernels import cpu as cpu_kernels

            kernels = f"a flat CPU layer loop on {cpu_kernels.describe()}"
        else:
            kernels = self.kernel_ops.name
        logger.info(
            "KV cache: %d tokens of %s (%.2f GB), max running requests %d, attention %s, kernels %s",
            self.max_total_tokens,
            str(self.kv_dtype).removeprefix("torch."),
            self.max_total_tokens * bytes_per_token / 1e9,
            self.max_running_requests,
            self.attn_backend_name,
            kernels,
        )
        self.graphs: GraphRunner | None = None
        if self.device.type == "cuda":
            self.attn_backend.warmup()
            self.sampler.warmup(self.dtype)
            t0 = time.perf_counter()
            if self.tp.rank == 0:
                for line in tune_skinny_linears(self.kernel_ops, self.model):
                    logger.info("skinny matmul: %s", line)
            if self.kernel_ops.tuner is not None:
                # Rank 0 tunes, the others take its picks: every rank has the same shard shapes
                self.kernel_ops.tuner.choice = self.tp.broadcast_object(self.kernel_ops.tuner.choice)
            logger.info("skinny matmul tuning took %.1f s", time.perf_counter() - t0)
            if not args.disable_cuda_graph:
                max_bs = min(
                    args.cuda_graph_max_bs or default_cuda_graph_max_bs(self.device), self.max_running_requests
                )
                self.graphs = GraphRunner(self, max_bs, args.extend_cuda_graph, args.extend_cuda_graph_max_tokens)
            self._warm_extend()

    def _warm_extend(self) -> None:
        """Run the extend shapes serving meets first once at start-up, so that the kernels they JIT-compile
        (attention over a prompt; decode rows riding along a prompt chunk) compile now, not inside the first
        requests' latency (a stall of up to a second on a fresh machine). Every row is the dummy request row and
        writes the padding slot."""
        if self.req_to_token_pool.max_context_len < 64:
            return
        t0 = time.perf_counter()
        row = self.req_to_token_pool.dummy_row
        for lens, prefixes in (([16], [0]), ([1, 1, 16], [40, 7, 0]), ([1, 24], [3, 5])):
            n = sum(lens)
            spec = BatchSpec(
                ForwardMode.EXTEND,
                [0] * n,
                [p + i for p, m in zip(prefixes, lens) for i in range(m)],
                [row] * len(lens),
                [p + m for p, m in zip(prefixes, lens)],
                torch.zeros(n, dtype=torch.int64),
                logits_indices=list(itertools.accumulate(lens, initial=-1))[1:],
                extend_prefix_lens=prefixes,
                extend_seq_lens=lens,
            )
            self.forward(self.build(spec))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("extend and mixed-step kernels warmed in %.1f s", time.perf_counter() - t0)

    def _default_kv_tokens(self, bytes_per_token: int, args) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = args.mem_fraction_static or _DEFAULT_GPU_MEM_FRACTION
            budget = total * fraction - (total - free)
            if budget <= 0:
                raise ValueError(f"mem_fraction_static={fraction} leaves no room for the KV cache after the weights")
            return int(budget // bytes_per_token)
        # Sized to the model: a CPU serves a few requests at a time, and a pool sized to the machine alone would
        # give a 135M model gigabytes it never fills (the radix cache keeps what is there, so it does fill).
        by_memory = int(_mem_available_bytes() * _CPU_KV_MEMORY_FRACTION // bytes_per_token)
        by_model = _CPU_KV_CONTEXTS * (self.context_length + 1)
        return max(1024, min(by_memory, by_model, _CPU_MAX_KV_TOKENS))

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None and self.graphs.decode is not None

    # --- forward -----------------------------------------------------------------------------------------------
    def build(self, spec: BatchSpec) -> ForwardBatch:
        """The batch's tensors on the device (futures resolved)."""
        return spec.build(self.device, self.future_map if spec.has_futures() else None)

    def prepare(self, fb: ForwardBatch) -> ForwardBatch:
        """Attach the pools and the attention backend, and plan the batch's attention metadata."""
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(fb)
        return fb

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The eager forward of a batch: float32 logits of its `logits_indices` rows."""
        with torch.inference_mode():
            return self.model(self.prepare(fb))

    def run_forward(self, spec: BatchSpec) -> torch.Tensor:
        """Launch a batch's forward: a graph replay where one fits, else eager. Float32 logits of its logits rows
        (decode: every row)."""
        if self.step_hook is not None:
            self.step_hook.before_forward(spec)
        logits = self.graphs.run(spec) if self.graphs is not None else None
        return logits if logits is not None else self.forward(self.build(spec))

    # --- sampling ----------------------------------------------------------------------------------------------
    def sample(
        self, logits: torch.Tensor | None, info: SamplingBatchInfo | None, extra: torch.Tensor | None = None
    ) -> PendingSample:
        """Sample every row of `logits` and start copying ids (+ logprobs, + `extra` float values) to the host."""
        with torch.inference_mode():
            pieces = []
            n = 0
            ids = torch.empty(0, dtype=torch.int64, device=self.device)
            if logits is not None and logits.shape[0]:
                n = logits.shape[0]
                ids = self.sampler.sample_ids(logits, info)
                pieces.append(self.sampler.result_columns(logits, ids, info).view(-1))
            if extra is not None:
                pieces.append(extra.double().view(-1))
            flat = (
                pieces[0]
                if len(pieces) == 1
                else (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float64, device=self.device))
            )
            return PendingSample(ids, n, info, self.staging.copy(flat), 0 if extra is None else extra.numel())

    def store_futures(self, ids: torch.Tensor) -> int:
        """Keep sampled ids on the device for the next step's inputs; returns the index of the first."""
        if self.step_hook is not None:
            self.step_hook.on_futures(ids)
        n = ids.shape[0]
        if self._future_next + n > self.future_map.shape[0]:
            self._future_next = 0
        base = self._future_next
        self.future_map[base : base + n].copy_(ids)
        self._future_next += n
        return base
