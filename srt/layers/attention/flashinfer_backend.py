"""Attention through FlashInfer over the same page-size-1 pool: tensor-core batch decode and paged prefill.

`plan` runs once per batch (in init_forward_metadata) from host-side lengths, so it never syncs the device;
the page table (every KV slot of every request, flattened) is gathered on the device from `req_to_token` by our
kernel. Extends use the paged prefill wrapper for prefix and new tokens alike: the new tokens' K/V are in the
pool already, and FlashInfer aligns the causal mask to the end of each request's KV.

FlashInfer compiles its kernels on first use (minutes for the sm90 prefill kernel on a fresh machine);
`warmup()` does that at start-up and logs it. Its cache lives under $FLASHINFER_WORKSPACE_BASE (default $HOME)
in .cache/flashinfer, so a second start is quick. Each module is built by its own ninja file when first used:
building them all at once through FlashInfer's combined ninja file (build_jit_specs) made every later start
rebuild them (each ninja log saw the other's outputs as stale: about a minute per process).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from radixlm.kernels.kv_indices import build_kv_indices
from radixlm.srt.layers.attention.base import AttentionBackend
from radixlm.srt.model_executor.forward_batch import ForwardBatch
from radixlm.srt.utils import exclusive, to_device

logger = logging.getLogger(__name__)

_WORKSPACE_BYTES = 256 << 20


@dataclass
class FlashInferMetadata:
    wrapper: object  # the planned decode or prefill wrapper this batch runs


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


class FlashInferAttnBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True
    replay_reads_inputs = True  # the page table is built from the request rows and lengths on the device

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        req_to_token: torch.Tensor,
        max_total_tokens: int,
        max_running: int,
        device: torch.device,
        prefill_backend: str = "fa2",
    ):
        import flashinfer

        self.fi = flashinfer
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.device = device
        self.req_to_token = req_to_token
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        # Decode with tensor cores runs FA2's prefill module; "fa3"/"auto" (Hopper) adds FlashAttention-3's.
        self.prefill_backend = prefill_backend
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=prefill_backend
        )
        # Requests sharing a prefix each list its slots, so the page table can outgrow the pool.
        self.max_indices = max(4 * max_total_tokens, 1 << 22)
        self.kv_indices = torch.empty(self.max_indices, dtype=torch.int32, device=device)
        self.ones = torch.ones(max(max_running, 1) + 1, dtype=torch.int32).pin_memory()
        self.graph_wrappers: dict[int, object] = {}
        self.graph_indices: torch.Tensor | None = None
        self._planned: torch.cuda.Event | None = None

    # --- planning ----------------------------------------------------------------------------------------------
    def _page_table(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(host indptr, device indices) for the batch's requests."""
        indptr = _indptr(fb.seq_lens_cpu)
        total = int(indptr[-1])
        if total > self.kv_indices.shape[0]:
            self.kv_indices = torch.empty(total * 2, dtype=torch.int32, device=self.device)
        build_kv_indices(
            self.req_to_token, fb.req_pool_indices, fb.seq_lens, to_device(indptr, self.device), self.kv_indices
        )
        return indptr, self.kv_indices[:total]

    def _before_plan(self) -> None:
        # plan() stages its schedule in one pinned buffer per wrapper and copies it to the device
        # asynchronously: never re-plan before the previous plan's copy has run.
        if self._planned is not None:
            self._planned.synchronize()

    def _after_plan(self) -> None:
        if self._planned is None:
            self._planned = torch.cuda.Event()
        self._planned.record()

    def _plan_decode(self, wrapper, fb: ForwardBatch) -> None:
        indptr, indices = self._page_table(fb)
        self._before_plan()
        wrapper.plan(
            indptr,
            indices,
            self.ones[: fb.batch_size],
            self.h,
            self.kvh,
            self.d,
            1,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.d**-0.5,
        )
        self._after_plan()

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode.is_decode:
            self._plan_decode(self.decode_wrapper, fb)
            fb.attn_metadata = FlashInferMetadata(self.decode_wrapper)
            return
        indptr, indices = self._page_table(fb)
        self._before_plan()
        self.prefill_wrapper.plan(
            _indptr(fb.extend_seq_lens_cpu),
            indptr,
            indices,
            self.ones[: fb.batch_size],
            self.h,
            self.kvh,
            self.d,
            1,
            causal=True,
            sm_scale=self.d**-0.5,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
        )
        self._after_plan()
        fb.attn_metadata = FlashInferMetadata(self.prefill_wrapper)

    # --- running -----------------------------------------------------------------------------------------------
    def _run(self, q, layer, fb: ForwardBatch) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        kv = (pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id])  # [slots, KVH, D]: page size 1
        return fb.attn_metadata.wrapper.run(q, kv).view(q.shape[0], -1)

    forward_decode = _run
    forward_extend = _run

    # --- CUDA graphs ---------------------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.graph_indices = torch.zeros(self.max_indices, dtype=torch.int32, device=self.device)

    def graph_fits(self, seq_lens_sum: int) -> bool:
        return self.graph_indices is not None and seq_lens_sum <= self.graph_indices.shape[0]

    def init_forward_metadata_capture(self, bs: int, fb: ForwardBatch) -> None:
        wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=self.graph_indices,
            paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=self.device),
        )
        self.graph_wrappers[bs] = wrapper
        self._plan_decode(wrapper, fb)
        fb.attn_metadata = FlashInferMetadata(wrapper)

    def init_forward_metadata_replay(self, bs: int, fb: ForwardBatch) -> None:
        self._plan_decode(self.graph_wrappers[bs], fb)

    # --- start-up ------------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile (or load from the cache) the kernels this backend runs, logging how long it took. Processes
        starting together (tensor-parallel ranks, replicas, a test beside a server) take turns: one builds a
        module, the others wait and load it from the cache, instead of all compiling it at once into the same
        files (concurrent builds of one module have failed the processes that loaded it half-written)."""
        logger.info(
            "FlashInfer: building/loading attention kernels (first start on a machine compiles them, "
            "which takes minutes; the cache is kept under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer)"
        )
        from flashinfer.jit.env import FLASHINFER_CACHE_DIR  # where FlashInfer keeps its builds

        start = time.perf_counter()
        with exclusive(FLASHINFER_CACHE_DIR / "radixlm-build.lock"):
            self._warm()
        logger.info("FlashInfer kernels ready in %.1f s", time.perf_counter() - start)

    def _warm(self) -> None:
        q = torch.zeros(1, self.h, self.d, dtype=self.dtype, device=self.device)
        kv = torch.zeros(2, 2, self.kvh, self.d, dtype=self.kv_dtype, device=self.device)
        ind = torch.zeros(1, dtype=torch.int32, device=self.device)
        one = torch.tensor([0, 1], dtype=torch.int32)
        self.decode_wrapper.plan(
            one,
            ind,
            self.ones[:1],
            self.h,
            self.kvh,
            self.d,
            1,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=self.d**-0.5,
        )
        self.decode_wrapper.run(q, (kv[0], kv[1]))
        self.prefill_wrapper.plan(
            one,
            one,
            ind,
            self.ones[:1],
            self.h,
            self.kvh,
            self.d,
            1,
            causal=True,
            sm_scale=self.d**-0.5,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
        )
        self.prefill_wrapper.run(q, (kv[0], kv[1]))
        torch.cuda.synchronize(self.device)
