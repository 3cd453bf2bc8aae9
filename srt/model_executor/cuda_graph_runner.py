"""Decode captured in CUDA graphs, one per batch size on a ladder up to `--cuda-graph-max-bs`.

Each graph reads only its own static buffers (input ids, positions, request rows, sequence lengths, KV slots:
one [5, bs] int64 tensor filled by one host->device copy) and the attention backend's captured metadata,
refreshed before each replay. A live batch is padded to the next captured size: padding rows decode token 0
at position 0 from the dummy request row into KV slot 0 (the reserved padding slot), and are dropped.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time

import numpy as np
import torch

from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)
_RING = 3  # pinned input buffers per graph size; under overlap scheduling at most two copies are in flight


def default_cuda_graph_max_bs(device: torch.device) -> int:
    total_gib = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    return 256 if total_gib >= 60 else (160 if total_gib >= 30 else 64)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, 1025, 16))
    sizes = [s for s in sizes if s < max_bs]
    return sizes + [max_bs]


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        self.backend = runner.attn_backend
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        self.dummy_row = runner.req_to_token_pool.dummy_row
        self.static: dict[int, torch.Tensor] = {}
        self.fbs: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._rings: dict[int, itertools.cycle] = {}  # per size: (pinned buffer, its numpy view, copy event)
        self._pad_column = np.array(self._padding(1), dtype=np.int64)
        self.backend.init_cuda_graph_state(self.max_bs)
        if hasattr(self.backend, "graph_bucket"):
            self.backend.graph_bucket = self.bucket
        for bs in self.sizes:
            self.static[bs] = torch.tensor(self._padding(bs), dtype=torch.int64).to(dev)
            self.fbs[bs] = self._forward_batch(bs)
        self._capture()

    def _padding(self, n: int) -> list[list[int]]:
        return [[0] * n, [0] * n, [self.dummy_row] * n, [1] * n, [0] * n]

    def _forward_batch(self, bs: int) -> ForwardBatch:
        ids, pos, rows, lens, loc = self.static[bs]
        r = self.runner
        return ForwardBatch(mode=ForwardMode.DECODE, batch_size=bs, input_ids=ids, positions=pos,
                            req_pool_indices=rows, seq_lens=lens, out_cache_loc=loc, seq_lens_cpu=[1] * bs,
                            req_to_token_pool=r.req_to_token_pool, token_to_kv_pool=r.token_to_kv_pool,
                            attn_backend=self.backend)

    def _capture(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.runner.device)[0]
        pool = None
        stream = torch.cuda.Stream(self.runner.device)
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                fb = self.fbs[bs]
                self.backend.init_forward_metadata_capture(bs, fb)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile and warm every kernel outside the capture
                        self.runner.model(fb)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bs] = self.runner.model(fb)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)
        used = free_before - torch.cuda.mem_get_info(self.runner.device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.2f GB", len(self.sizes),
                    self.sizes[0], self.max_bs, time.perf_counter() - start, used / 1e9)

    def _staging(self, gbs: int) -> tuple[torch.Tensor, np.ndarray, torch.cuda.Event]:
        """The next pinned [5, gbs] buffer of this size's ring, its numpy view and the event its last copy
        recorded, once that copy has run. Reused buffers, not one allocation per step: at batch 1 the host's
        time before the replay is time the GPU waits."""
        ring = self._rings.get(gbs)
        if ring is None:
            bufs = [torch.empty(5, gbs, dtype=torch.int64, pin_memory=True) for _ in range(_RING)]
            ring = self._rings[gbs] = itertools.cycle([(buf, buf.numpy(), torch.cuda.Event()) for buf in bufs])
        host, fill, done = next(ring)
        done.synchronize()  # long done: the copy ran before the replay _RING steps ago
        return host, fill, done

    def bucket(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)] if bs <= self.max_bs else bs

    def can_run(self, bs: int, seq_lens: list[int]) -> bool:
        if bs > self.max_bs:
            return False
        fits = getattr(self.backend, "graph_fits", None)
        return fits is None or fits(sum(seq_lens) + self.max_bs)

    def replay(self, input_ids: list[int], positions: list[int], rows: list[int], seq_lens: list[int],
               out_cache_loc: torch.Tensor, future_map: torch.Tensor | None) -> torch.Tensor:
        """Logits [bs, vocab] (a view of the graph's output buffer, valid until the next replay)."""
        bs = len(seq_lens)
        gbs = self.bucket(bs)
        pad = gbs - bs
        host, fill, done = self._staging(gbs)
        fill[0, :bs] = input_ids
        fill[1, :bs] = positions
        fill[2, :bs] = rows
        fill[3, :bs] = seq_lens
        fill[4, :bs] = out_cache_loc.numpy()
        if pad:
            fill[:, bs:] = self._pad_column
        static = self.static[gbs]
        static.copy_(host, non_blocking=True)
        done.record()
        if future_map is not None:
            ids = static[0]
            ids.copy_(torch.where(ids < 0, future_map[(-ids - 1).clamp_min(0)], ids))
        fb = self.fbs[gbs]
        fb.seq_lens_cpu = list(seq_lens) + [1] * pad
        self.backend.init_forward_metadata_replay(gbs, fb)
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]
