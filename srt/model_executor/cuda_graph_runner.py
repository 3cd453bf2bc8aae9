"""Decode captured in CUDA graphs, one per batch size on a ladder up to `--cuda-graph-max-bs`.

Each graph reads only its own static buffers (input ids, positions, request rows, sequence lengths, KV slots:
one [5, bs] int64 tensor) and the attention backend's captured metadata, refreshed before each replay. The
host writes a replay's inputs into the next slot of a ring of pinned buffers; the graph's first kernel reads
that slot itself (kernels/graph_inputs.py), so a replay costs the host a few numpy stores and the launch. A
backend whose replay metadata reads the inputs on the device (FlashInfer plans from them) gets the same kernel
launched eagerly before that metadata instead. Each size is captured as two graphs, a one-layer head and the
rest (`head_layers`), so that the device starts as soon as the small head is launched. A live batch is padded
to the next captured size: padding rows decode token 0 at position 0 from the dummy request row into KV slot 0
(the reserved padding slot), and are dropped.
"""
from __future__ import annotations

import bisect
import logging
import os
import time

import numpy as np
import torch

from radixlm.kernels.graph_inputs import pull_inputs
from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)
_RING = 3  # pinned input slots per graph size; under overlap scheduling at most two replays are in flight


def default_cuda_graph_max_bs(device: torch.device) -> int:
    total_gib = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    return 256 if total_gib >= 60 else (160 if total_gib >= 30 else 64)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 129, 8)) + list(range(144, 1025, 16))
    sizes = [s for s in sizes if s < max_bs]
    return sizes + [max_bs]


def head_layers(num_layers: int) -> int:
    """Layers in a decode graph's head (0: one graph per size). The device starts a graph's first kernel only
    once the host's launch call has returned, and launching a whole step's ~300 nodes takes the host 30-140 us
    on the H100 machines measured; a head of one layer is launched in a fraction of that, and the tail's launch
    then runs while the device works through the head. RADIXLM_GRAPH_HEAD sets it (0 turns the split off)."""
    return max(0, min(int(os.environ.get("RADIXLM_GRAPH_HEAD", "1")), num_layers - 1))


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
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # per size: head and tail, or one graph
        self.outputs: dict[int, torch.Tensor] = {}
        self.head_layers = head_layers(runner.config.num_layers)
        self._carry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # head -> tail (hidden, residual)
        self.future_map = runner.future_map
        self.inputs_in_graph = not self.backend.replay_reads_inputs
        # Per size: the pinned input ring [_RING, 5, bs] and its numpy view, the device's count of replays
        # (which slot the next one reads), the host's count, and per slot an event recorded after the replay
        # that read it (the slot is free again once it has run).
        self._ring: dict[int, torch.Tensor] = {}
        self._fill: dict[int, np.ndarray] = {}
        self._counter: dict[int, torch.Tensor] = {}
        self._turn: dict[int, int] = {}
        self._read: dict[int, list[torch.cuda.Event]] = {}
        self._pad_column = np.array(self._padding(1), dtype=np.int64)
        self.backend.init_cuda_graph_state(self.max_bs)
        if hasattr(self.backend, "graph_bucket"):
            self.backend.graph_bucket = self.bucket
        for bs in self.sizes:
            pad = torch.tensor(self._padding(bs), dtype=torch.int64)
            self.static[bs] = pad.to(dev)
            self._ring[bs] = pad.expand(_RING, 5, bs).contiguous().pin_memory()
            self._fill[bs] = self._ring[bs].numpy()
            self._counter[bs] = torch.zeros(1, dtype=torch.int64, device=dev)
            self._read[bs] = [torch.cuda.Event() for _ in range(_RING)]
            self.fbs[bs] = self._forward_batch(bs)
        self._capture()
        for bs in self.sizes:  # the warm-up runs advanced the device's counts
            self._counter[bs].zero_()
            self._turn[bs] = 0
        torch.cuda.synchronize(dev)

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
                parts = 2 if self.head_layers else 1
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile and warm every kernel outside the capture
                        if not self.inputs_in_graph:  # launched eagerly at replay: compile it now too
                            self._pull(bs)
                        carry = None
                        for i in range(parts):
                            carry = self._part(bs, i, carry)
                torch.cuda.current_stream().wait_stream(stream)
                self.graphs[bs] = []
                carry = None
                for i in range(parts):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        carry = self._part(bs, i, carry)
                    pool = graph.pool()
                    self.graphs[bs].append(graph)
                    if i < parts - 1:
                        self._carry[bs] = carry
                self.outputs[bs] = carry
        torch.cuda.synchronize(self.runner.device)
        used = free_before - torch.cuda.mem_get_info(self.runner.device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d%s) in %.1f s, %.2f GB", len(self.sizes),
                    self.sizes[0], self.max_bs, f", each as a {self.head_layers}-layer head and a tail"
                    if self.head_layers else "", time.perf_counter() - start, used / 1e9)

    def _part(self, bs: int, i: int, carry):
        """Part i of the step: the whole forward, or its head (i = 0) and tail (i = 1). The first part starts
        by reading the inputs where the graph does that itself."""
        fb, model = self.fbs[bs], self.runner.model
        if i == 0 and self.inputs_in_graph:
            self._pull(bs)
        if not self.head_layers:
            return model(fb)
        if i == 0:
            return model.forward_head(fb, self.head_layers)
        return model.forward_tail(*carry, fb, self.head_layers)

    def _pull(self, bs: int) -> None:
        pull_inputs(self._ring[bs], self._counter[bs], self.static[bs], self.future_map)

    def bucket(self, bs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, bs)] if bs <= self.max_bs else bs

    def can_run(self, bs: int, seq_lens: list[int]) -> bool:
        if bs > self.max_bs:
            return False
        fits = getattr(self.backend, "graph_fits", None)
        return fits is None or fits(sum(seq_lens) + self.max_bs)

    def replay(self, input_ids: list[int], positions: list[int], rows: list[int], seq_lens: list[int],
               out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Logits [bs, vocab] (a view of the graph's output buffer, valid until the next replay). Negative
        input ids are futures: the token at index -1 - id of the runner's future map."""
        bs = len(seq_lens)
        gbs = self.bucket(bs)
        turn = self._turn[gbs]
        read = self._read[gbs][turn % _RING]
        read.synchronize()  # long done: the replay _RING turns ago read this slot
        fill = self._fill[gbs][turn % _RING]
        fill[0, :bs] = input_ids
        fill[1, :bs] = positions
        fill[2, :bs] = rows
        fill[3, :bs] = seq_lens
        fill[4, :bs] = out_cache_loc.numpy()
        if gbs > bs:
            fill[:, bs:] = self._pad_column
        self._launch(gbs, seq_lens)
        return self.outputs[gbs][:bs]

    def relaunch(self, bs: int) -> None:
        """Replay the graph of `bs` rows again on the inputs of its last replay (benchmarks: the launch alone).
        A bare `graphs[...].replay()` would desynchronise the host's count of replays from the device's."""
        gbs = self.bucket(bs)
        turn = self._turn[gbs]
        self._read[gbs][turn % _RING].synchronize()
        self._fill[gbs][turn % _RING] = self._fill[gbs][(turn - 1) % _RING]
        with torch.inference_mode():
            self._launch(gbs, None)

    def _launch(self, gbs: int, seq_lens: list[int] | None) -> None:
        """seq_lens: the live rows' (None: as at the last replay), for metadata that plans on the host."""
        turn = self._turn[gbs]
        try:
            if not self.inputs_in_graph:
                self._pull(gbs)
                fb = self.fbs[gbs]
                if seq_lens is not None:
                    fb.seq_lens_cpu = list(seq_lens) + [1] * (gbs - len(seq_lens))
                self.backend.init_forward_metadata_replay(gbs, fb)
            for graph in self.graphs[gbs]:
                graph.replay()
        except BaseException:
            # However far this replay got, the next one must read the next slot: a count out of step would
            # have every later replay of this size read an earlier step's inputs.
            self._counter[gbs].fill_(turn + 1)
            self._turn[gbs] = turn + 1
            raise
        self._turn[gbs] = turn + 1
        self._read[gbs][turn % _RING].record()
