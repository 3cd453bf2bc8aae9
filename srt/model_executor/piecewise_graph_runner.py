"""Extend and mixed batches in piecewise CUDA graphs: everything but attention captured, attention eager.

Decode graphs cover batches of one token per request. A batch with prompt tokens in it (a prefill chunk, with
running decodes riding along under `--enable-mixed-chunk`) has ragged attention metadata that a graph cannot
hold, so it used to run fully eager: ~500 kernel launches from Python for an 8B model, 15-20 ms of host time
per step whatever its size, which is the whole inter-token latency tail of a serving run. Here the forward of
a batch of T tokens is split at the attention kernels into L + 1 pieces (embedding + layer 0 up to its
attention; layer i's output half + layer i+1 up to its attention; the last output half + the final norm),
each captured once per token bucket. A step replays piece 0, runs layer 0's attention eagerly over the real
rows, replays piece 1, and so on: L + 1 graph launches and L attention calls.

The pieces exchange tensors through fixed buffers (sized for the largest bucket, viewed per bucket): q and
the residual leave a piece, attention output enters the next. Padding rows (bucket - T) read token 0 at
position 0 and write their K/V into slot 0, the pool's reserved padding slot; attention never reads them
and their rows are dropped before the LM head.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    # Steps of 32 around the common chunk sizes: a 256-token chunk with 32 decodes riding along is 288 tokens,
    # which a step of 128 would pad to 384 (a third more prefill compute in every such step).
    ladder = [16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512, 544, 576, 640, 768, 896, 1024,
              1280, 1536, 2048, 2560, 3072, 4096, 6144, 8192]
    return [b for b in ladder if b < max_tokens] + [max_tokens]


class PiecewiseGraphRunner:
    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        model = runner.model
        self.inner = model.model  # embedding, layers, final norm
        self.layers = list(self.inner.layers)
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        cfg = runner.config
        dev, dt = runner.device, runner.dtype
        t = self.max_tokens
        self.ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(t, dtype=torch.int64, device=dev)
        self.loc = torch.zeros(t, dtype=torch.int64, device=dev)
        q_size = cfg.num_heads * cfg.head_dim
        self.q = torch.zeros(t, cfg.num_heads, cfg.head_dim, dtype=dt, device=dev)
        self.attn_out = torch.zeros(t, q_size, dtype=dt, device=dev)
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dt, device=dev)
        self.hidden = torch.zeros(t, cfg.hidden_size, dtype=dt, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.static_fbs = {n: self._static_fb(n) for n in self.buckets}
        # Without CUDA the pieces run as plain calls: the same decomposition, testable on a CPU.
        self.use_graphs = dev.type == "cuda"
        if self.use_graphs:
            self._capture()

    # --- the pieces --------------------------------------------------------------------------------------
    def _static_fb(self, n: int) -> ForwardBatch:
        """What the captured pieces read of a batch: positions, KV slots and the pool (never the metadata)."""
        r = self.runner
        return ForwardBatch(mode=ForwardMode.EXTEND, batch_size=1, input_ids=self.ids[:n], positions=self.pos[:n],
                            req_pool_indices=self.ids[:1], seq_lens=self.ids[:1], out_cache_loc=self.loc[:n],
                            seq_lens_cpu=[n], req_to_token_pool=r.req_to_token_pool,
                            token_to_kv_pool=r.token_to_kv_pool)

    def _piece(self, i: int, n: int, fb: ForwardBatch) -> None:
        """Piece i of a bucket of n tokens: layer i-1's output half (i > 0), then layer i up to its attention
        (i < L) or the final norm (i == L)."""
        if i == 0:
            x, residual = self.inner.embed_tokens(self.ids[:n]), None
        else:
            x, residual = self.layers[i - 1].post_attention(self.attn_out[:n], self.residual[:n])
        if i < len(self.layers):
            q, residual = self.layers[i].pre_attention(self.pos[:n], x, residual, fb)
            self.q[:n].copy_(q)
            self.residual[:n].copy_(residual)
        else:
            x, _ = self.inner.norm(x, residual)
            self.hidden[:n].copy_(x)

    def _capture(self) -> None:
        start = time.perf_counter()
        dev = self.runner.device
        free_before = torch.cuda.mem_get_info(dev)[0]
        pool = None
        stream = torch.cuda.Stream(dev)
        pieces = len(self.layers) + 1
        with torch.inference_mode():
            for n in reversed(self.buckets):  # largest first: smaller buckets reuse its memory pool
                fb = self.static_fbs[n]
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for i in range(pieces):  # compile and warm every kernel outside the capture
                        self._piece(i, n, fb)
                torch.cuda.current_stream().wait_stream(stream)
                graphs = []
                for i in range(pieces):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self._piece(i, n, fb)
                    pool = g.pool()
                    graphs.append(g)
                self.graphs[n] = graphs
        torch.cuda.synchronize(dev)
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        logger.info("captured piecewise CUDA graphs for extend batches (%d buckets of %d..%d tokens, %d pieces "
                    "each) in %.1f s, %.2f GB", len(self.buckets), self.buckets[0], self.max_tokens, pieces,
                    time.perf_counter() - start, used / 1e9)

    # --- running -----------------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        """Any batch of at most max_tokens (decode batches land here only when larger than the decode graphs)."""
        return fb.num_tokens <= self.max_tokens

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits of `fb.logits_indices`, as the eager forward returns them; `fb` has its attention
        metadata initialised."""
        n = fb.num_tokens
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        self.ids[:n].copy_(fb.input_ids)
        self.pos[:n].copy_(fb.positions)
        self.loc[:n].copy_(fb.out_cache_loc)
        if bucket > n:
            self.ids[n:bucket].zero_()
            self.pos[n:bucket].zero_()
            self.loc[n:bucket].zero_()
        if self.use_graphs:
            graphs = self.graphs[bucket]
            run = lambda i: graphs[i].replay()  # noqa: E731
        else:
            static = self.static_fbs[bucket]
            run = lambda i: self._piece(i, bucket, static)  # noqa: E731
        q = self.q[:n]
        for i, layer in enumerate(self.layers):
            run(i)
            self.attn_out[:n].copy_(layer.self_attn.attn(q, fb))
        run(len(self.layers))
        return self.runner.model.logits(self.hidden[:n], fb)
