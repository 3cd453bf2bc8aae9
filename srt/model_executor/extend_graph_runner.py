"""Extend and mixed batches in whole CUDA graphs, attention included (backends with `supports_extend_graph`).

The piecewise graphs (piecewise_graph_runner.py) leave attention eager because its metadata is ragged. That
still costs a step L + 1 graph launches and L eager attention calls from Python: on a busy H100 host the
launch phase of a mixed step (a prompt chunk with 32 decodes riding along) took 4-9 ms at p50 and up to 25 ms
at p99, longer than the device took to run it, and those steps are the inter-token tail of a serving run.

Here the whole forward of a bucket of T tokens is one graph. The batch's attention metadata travels in a fixed
layout sized for the bucket (the backend's `ExtendLayout`: one-token rows for the fixed-launch decode kernel,
a block table for the extend kernel, counts read on the device), so the same launches serve any batch that
fits. A step is a few numpy stores into a pinned buffer, one copy to the device, one graph launch, and the
LM head over the rows that need logits. Input ids may be futures (overlap scheduling); the graph resolves them
from the runner's future map. Padding rows read token 0 at position 0 and write their K/V into slot 0, the
pool's reserved padding slot; attention never reads them and no logits are taken from them.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardBatch, ForwardMode, resolve_futures
from radixlm.srt.model_executor.piecewise_graph_runner import token_buckets

logger = logging.getLogger(__name__)

_RING = 3  # pinned input buffers per bucket in rotation (a slot is reused once its copy has run)


@dataclass
class _Bucket:
    tokens: int
    layout: object  # the backend's ExtendLayout
    meta: torch.Tensor  # device int64: [ids, positions, KV slots, logits rows] x tokens, then the attention part
    fb: ForwardBatch
    hosts: list[torch.Tensor]
    events: list[torch.cuda.Event | None]
    turn: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None


class ExtendGraphRunner:
    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        self.backend = runner.attn_backend
        self.inner = runner.model.model  # embedding, layers, final norm
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        self.use_graphs = runner.device.type == "cuda"  # without CUDA: the same static path as plain calls
        self.slots: dict[int, _Bucket] = {t: self._bucket(t) for t in self.buckets}
        if self.use_graphs:
            self._capture()

    def _bucket(self, t: int) -> _Bucket:
        r = self.runner
        layout = self.backend.extend_graph_layout(t, r.max_running_requests)
        meta = torch.zeros(4 * t + layout.size, dtype=torch.int64, device=r.device)
        fb = ForwardBatch(mode=ForwardMode.EXTEND, batch_size=1, input_ids=meta[:t], positions=meta[t:2 * t],
                          req_pool_indices=meta[:1], seq_lens=meta[:1], out_cache_loc=meta[2 * t:3 * t],
                          seq_lens_cpu=[t], req_to_token_pool=r.req_to_token_pool,
                          token_to_kv_pool=r.token_to_kv_pool, attn_backend=self.backend)
        fb.attn_metadata = self.backend.extend_metadata(meta[4 * t:], layout)
        hosts = [torch.zeros_like(meta, device="cpu", pin_memory=self.use_graphs) for _ in range(_RING)]
        return _Bucket(t, layout, meta, fb, hosts, [None] * _RING)

    def _forward(self, bk: _Bucket) -> torch.Tensor:
        """The captured part: futures resolved, then embedding, every layer, the final norm."""
        return self.inner(resolve_futures(bk.fb.input_ids, self.runner.future_map), bk.fb.positions, bk.fb)

    def _capture(self) -> None:
        start = time.perf_counter()
        r = self.runner
        dev = r.device
        free_before = torch.cuda.mem_get_info(dev)[0]
        pool = None
        stream = torch.cuda.Stream(dev)
        with torch.inference_mode():
            for t in reversed(self.buckets):  # largest first: smaller buckets reuse its memory pool
                bk = self.slots[t]
                self._fill(bk, bk.hosts[0], [0], [0], [0], [1], [0], [], [r.req_to_token_pool.dummy_row], [1])
                bk.meta.copy_(bk.hosts[0])
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._forward(bk)  # compile and warm every kernel outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                bk.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bk.graph, pool=pool, stream=stream):
                    bk.hidden = self._forward(bk)
                pool = bk.graph.pool()
        torch.cuda.synchronize(dev)
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        logger.info("captured whole CUDA graphs for extend batches (%d buckets of %d..%d tokens) in %.1f s, %.2f GB",
                    len(self.buckets), self.buckets[0], self.max_tokens, time.perf_counter() - start, used / 1e9)

    # --- running -----------------------------------------------------------------------------------------
    def can_run(self, spec: BatchSpec) -> bool:
        n = len(spec.input_ids)
        if spec.mode is not ForwardMode.EXTEND or not 0 < n <= self.max_tokens:
            return False
        bk = self.slots[self.buckets[bisect.bisect_left(self.buckets, n)]]
        return self.backend.fits_extend(bk.layout, spec.extend_seq_lens)

    def _fill(self, bk: _Bucket, host: torch.Tensor, ids, positions, loc, extend_lens, prefix_lens, rows_logits,
              req_rows, seq_lens) -> None:
        t, n = bk.tokens, len(ids)
        arr = host.numpy()
        arr[:4 * t] = 0
        arr[0:n] = ids
        arr[t:t + n] = positions
        arr[2 * t:2 * t + n] = loc
        arr[3 * t:3 * t + len(rows_logits)] = rows_logits
        self.backend.fill_extend(arr[4 * t:], bk.layout, prefix_lens, extend_lens, req_rows, seq_lens)

    def run(self, spec: BatchSpec) -> torch.Tensor:
        """Float32 logits of the spec's `logits_indices` rows (every row when None); `can_run(spec)` holds."""
        n = len(spec.input_ids)
        bk = self.slots[self.buckets[bisect.bisect_left(self.buckets, n)]]
        t = bk.tokens
        i = bk.turn
        bk.turn = (i + 1) % _RING
        if bk.events[i] is not None:
            bk.events[i].synchronize()  # the copy from this slot three replays ago (long done in practice)
        host = bk.hosts[i]
        rows_logits = spec.logits_indices if spec.logits_indices is not None else range(n)
        self._fill(bk, host, spec.input_ids, spec.positions, spec.out_cache_loc.numpy(), spec.extend_seq_lens,
                   spec.extend_prefix_lens, rows_logits, spec.req_pool_indices, spec.seq_lens)
        bk.meta.copy_(host, non_blocking=True)
        if self.use_graphs:
            bk.events[i] = torch.cuda.Event()
            bk.events[i].record()
            bk.graph.replay()
            hidden = bk.hidden
        else:
            hidden = self._forward(bk)
        k = len(rows_logits)
        return self.runner.model.project(hidden.index_select(0, bk.meta[3 * t:3 * t + k]))
