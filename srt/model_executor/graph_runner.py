"""CUDA graphs for every batch kind (decode, whole extend, piecewise extend) in one runner.

A forward is a list of stages on the model's seam: embed; per layer pre-attention, attention, post-attention;
the final norm; the logits. A graph kind cuts that list into segments, each captured as one graph or run
eagerly between graphs:

  decode     [embed .. layer 0] [layer 1 .. norm, logits]   attention inside. The one-layer head is launched
                                                             in a fraction of a whole step's launch time, so the
                                                             device starts while the host launches the tail.
  whole      [embed .. norm] then logits                     extend and mixed batches with attention inside, for
                                                             backends whose extend metadata has a fixed layout
  piecewise  [embed, pre 0] attn 0 [post 0, pre 1] attn 1 .. [post L-1, norm] then logits
                                                             any backend: attention eager over the real rows,
                                                             everything between captured

Each kind keeps graphs per bucket of one ladder (`buckets`: batch sizes for decode, token counts for extend).
Inputs reach every graph the same way: the host writes one flat int64 vector (ids first, then positions, KV
slots and what else the kind reads) into the next slot of a pinned ring, and the first segment's first kernel
pulls that slot and resolves futures (kernels/graph_inputs.py); a replay is a few numpy stores and the
launches. A batch is padded to its bucket: padding rows read token 0 at position 0, write their K/V into slot 0
(the pool's reserved padding slot) and are dropped. What a graph hands to the next graph stays that
graph's own tensors (per bucket: only decode's head has such a hand-off, and its buckets are small); what goes
to or comes from an eager call (piecewise attention) passes through fixed buffers every bucket shares, since
piecewise buckets are large and have a hand-off per layer. The last graph's output (logits, or hidden states
for the eager LM head over the rows that need it) is per bucket. Without CUDA the segments run as plain calls: the same
decomposition, testable on a CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from radixlm.kernels.graph_inputs import pull_inputs, pull_inputs_ref
from radixlm.srt.distributed.parallel import PartialSum
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixlm.srt.layers.attention.triton_backend import ExtendLayout
    from radixlm.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Batch sizes and token counts graphs are captured for. Fine steps where decode batches live; around the common
# prefill chunks, steps of 32: a 256-token chunk with 32 decodes riding along is 288 tokens, which a step of 128
# would pad to 384 (a third more prefill compute in every such step).
LADDER = (
    [1, 2, 4, 8]
    + list(range(16, 129, 8))
    + list(range(144, 257, 16))
    + [288, 320, 384, 448, 512, 544, 576, 640, 768, 896, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 6144, 8192]
)
EXTEND_MIN_BUCKET = 16
_RING = 3  # input slots per bucket; under overlap scheduling at most two replays are in flight
_HEAD_LAYERS = 1

ExtendGraphMode = Literal["auto", "whole", "piecewise", "off"]


def buckets(lo: int, hi: int) -> list[int]:
    """The ladder's sizes from lo up to hi, hi always included."""
    return [b for b in LADDER if lo <= b < hi] + [hi]


def default_cuda_graph_max_bs(device: torch.device) -> int:
    total_gib = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    return 256 if total_gib >= 60 else (160 if total_gib >= 30 else 64)


# --- the model's seam as ops on a state (x, residual, q, a: attention output, hidden, logits) -----------------
Op = tuple[str, int]  # (stage, layer)


def forward_ops(num_layers: int) -> list[Op]:
    ops: list[Op] = [("embed", 0)]
    for i in range(num_layers):
        ops += [("pre", i), ("attn", i), ("post", i)]
    return ops + [("norm", 0), ("logits", 0)]


@dataclass
class Segment:
    ops: list[Op]
    graphed: bool
    reads: tuple[str, ...] = ()  # state an earlier graph left in the shared carry buffers
    writes: tuple[str, ...] = ()  # state this graph leaves there for a later segment


def plan(kind: str, num_layers: int) -> list[Segment]:
    """The segments of one kind (see the module docstring); the extend kinds' logits are taken by the runner."""
    ops = forward_ops(num_layers)
    if kind == "whole":
        return [Segment(ops[:-1], True)]
    if kind == "decode":
        cut = 1 + 3 * _HEAD_LAYERS
        if not 0 < _HEAD_LAYERS < num_layers:
            return [Segment(ops, True)]
        return [Segment(ops[:cut], True, writes=("x", "residual")), Segment(ops[cut:], True, reads=("x", "residual"))]
    # piecewise: a graph between attentions; the residual skips over each attention, q goes into it
    segs: list[Segment] = []
    run: list[Op] = []
    for op in ops[:-1]:
        if op[0] != "attn":
            run.append(op)
            continue
        segs += [
            Segment(run, True, reads=("a", "residual") if segs else (), writes=("q", "residual")),
            Segment([op], False),
        ]
        run = []
    return segs + [Segment(run, True, reads=("a", "residual"))]


class Stages:
    """Runs ops on a state dict against the model (LlamaForCausalLM's seam)."""

    def __init__(self, model):
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)

    def run(self, ops: list[Op], st: dict, fb: ForwardBatch) -> None:
        for stage, i in ops:
            if stage == "embed":
                st["x"], st["residual"] = self.inner.embed_tokens(fb.input_ids), None
            elif stage == "pre":
                st["q"], st["residual"] = self.layers[i].pre_attention(fb.positions, st.pop("x"), st["residual"], fb)
            elif stage == "attn":
                st["a"] = self.layers[i].self_attn.attn(st["q"], fb)
            elif stage == "post":
                st["x"], st["residual"] = self.layers[i].post_attention(st["a"], st["residual"])
            elif stage == "norm":
                st["hidden"], _ = self.inner.norm(st.pop("x"), st["residual"])
            else:
                st["logits"] = self.model.logits(st["hidden"], fb)
        x = st.get("x")
        if isinstance(x, PartialSum):  # a row-parallel share crossing into another segment: summed here
            st["x"] = x.reduced()


@dataclass(eq=False)
class _Bucket:
    size: int  # batch size (decode) or tokens (extend)
    ring: torch.Tensor  # [_RING, n] int64 inputs, pinned on CUDA
    static: torch.Tensor  # [n] the inputs the graphs read
    counter: torch.Tensor  # [2] the device's count of replays (which slot the next pulls) and kernel scratch
    fb: ForwardBatch
    layout: ExtendLayout | None = None  # whole extend: the backend's fixed metadata layout
    graphs: list = field(default_factory=list)
    output: torch.Tensor | None = None  # what the last graph leaves: logits (decode) or hidden states
    handoff: dict = field(default_factory=dict)  # what a graph leaves the next graph (its own tensors)
    turn: int = 0
    read: list = field(default_factory=lambda: [None] * _RING)  # per slot: an event after the replay that read it


class GraphSet:
    """One kind's graphs: a bucket per ladder size, the segments of `plan(kind)`."""

    def __init__(self, kind: str, runner: ModelRunner, sizes: list[int], carry: dict[str, torch.Tensor]):
        self.kind = kind
        self.runner = runner
        self.backend = runner.attn_backend
        self.stages = Stages(runner.model)
        self.segments = plan(kind, len(self.stages.layers))
        self.sizes = sizes
        self.max_size = sizes[-1]
        self.carry = carry
        self.cuda = runner.device.type == "cuda"
        # A backend whose replay metadata reads the inputs on the device (FlashInfer plans from the request rows
        # and lengths) has the decode inputs pulled eagerly before that metadata, not by the graph's first kernel.
        self.pull_in_graph = not (kind == "decode" and self.backend.replay_reads_inputs)
        if kind == "decode":
            self.backend.init_cuda_graph_state(self.max_size)
            if hasattr(self.backend, "graph_bucket"):  # eager decode splits the KV as the graphs do
                self.backend.graph_bucket = self.bucket_size
        self.buckets = {s: self._bucket(s) for s in sizes}

    # --- inputs: [ids, positions, rows, seq lens, KV slots] x bs for decode; [ids, positions, KV slots, logits
    # rows] x tokens for extend, then the whole kind's attention layout ---------------------------------------
    def _bucket(self, n: int) -> _Bucket:
        r, dev = self.runner, self.runner.device
        layout = None
        width = 5 * n if self.kind == "decode" else 4 * n
        if self.kind == "whole":
            layout = self.backend.extend_graph_layout(n, r.max_running_requests)
            width += layout.size
        static = torch.zeros(width, dtype=torch.int64, device=dev)
        ring = torch.zeros(_RING, width, dtype=torch.int64, pin_memory=self.cuda)
        if self.kind == "decode":
            v = static.view(5, n)
            fb = ForwardBatch(
                mode=ForwardMode.DECODE,
                batch_size=n,
                input_ids=v[0],
                positions=v[1],
                req_pool_indices=v[2],
                seq_lens=v[3],
                out_cache_loc=v[4],
                seq_lens_cpu=[1] * n,
            )
            ring.view(_RING, 5, n)[:, 2] = r.req_to_token_pool.dummy_row
            ring.view(_RING, 5, n)[:, 3] = 1
            static.copy_(ring[0])
            fb.req_to_token_pool, fb.token_to_kv_pool = r.req_to_token_pool, r.token_to_kv_pool
            self.backend.init_forward_metadata_capture(n, fb)  # the decode metadata the graphs keep
        else:
            fb = ForwardBatch(
                mode=ForwardMode.EXTEND,
                batch_size=1,
                input_ids=static[:n],
                positions=static[n : 2 * n],
                req_pool_indices=static[:1],
                seq_lens=static[:1],
                out_cache_loc=static[2 * n : 3 * n],
                seq_lens_cpu=[n],
            )
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = (
            r.req_to_token_pool,
            r.token_to_kv_pool,
            self.backend,
        )
        if layout is not None:  # room for one padding row, until a batch is written
            self.backend.fill_extend(ring[0, 4 * n :].numpy(), layout, [0], [1], [r.req_to_token_pool.dummy_row], [1])
            ring[1:, 4 * n :] = ring[0, 4 * n :]
            fb.attn_metadata = self.backend.extend_metadata(static[4 * n :], layout)
        static.copy_(ring[0])  # what the graphs read before the first pull: padding
        return _Bucket(n, ring, static, torch.zeros(2, dtype=torch.int64, device=dev), fb, layout)

    def _write(self, bk: _Bucket, arr: np.ndarray, spec: BatchSpec) -> None:
        n, m = bk.size, len(spec.input_ids)
        loc = spec.out_cache_loc.numpy()
        if self.kind == "decode":
            v = arr.reshape(5, n)
            v[0, :m], v[1, :m], v[2, :m], v[3, :m], v[4, :m] = (
                spec.input_ids,
                spec.positions,
                spec.req_pool_indices,
                spec.seq_lens,
                loc,
            )
            v[:, m:] = ((0,), (0,), (self.runner.req_to_token_pool.dummy_row,), (1,), (0,))
            return
        arr[: 4 * n] = 0
        arr[:m], arr[n : n + m], arr[2 * n : 2 * n + m] = spec.input_ids, spec.positions, loc
        rows = spec.logits_indices if spec.logits_indices is not None else range(m)
        arr[3 * n : 3 * n + len(rows)] = rows
        if bk.layout is not None:
            self.backend.fill_extend(
                arr[4 * n :],
                bk.layout,
                spec.extend_prefix_lens,
                spec.extend_seq_lens,
                spec.req_pool_indices,
                spec.seq_lens,
            )

    def _pull(self, bk: _Bucket) -> None:
        pull = pull_inputs if self.cuda else pull_inputs_ref
        pull(bk.ring, bk.counter, bk.static, self.runner.future_map, bk.size)

    # --- which batches ----------------------------------------------------------------------------------------
    def bucket_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)] if n <= self.max_size else n

    def fits(self, spec: BatchSpec) -> bool:
        if self.kind == "decode":
            if spec.mode is not ForwardMode.DECODE or spec.batch_size > self.max_size:
                return False
            fits = getattr(self.backend, "graph_fits", None)
            return fits is None or fits(sum(spec.seq_lens) + self.max_size)
        n = len(spec.input_ids)
        if not 0 < n <= self.max_size:
            return False
        if self.kind == "whole":
            return spec.mode is ForwardMode.EXTEND and self.backend.fits_extend(
                self.buckets[self.bucket_size(n)].layout, spec.extend_seq_lens
            )
        return True  # piecewise: any batch (decode batches too, past the decode graphs)

    # --- capture -------------------------------------------------------------------------------------------
    def capture(self, pool):
        """Capture every bucket, largest first (smaller ones reuse its memory); returns the memory pool."""
        stream = torch.cuda.Stream(self.runner.device)
        for n in reversed(self.sizes):
            bk = self.buckets[n]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and warm every kernel outside the capture
                    if not self.pull_in_graph:  # launched eagerly at replay: compile it now too
                        self._pull(bk)
                    self._run_segments(bk, None)
            torch.cuda.current_stream().wait_stream(stream)
            bk.graphs = []
            self._run_segments(bk, None, capture=(stream, pool))
            pool = bk.graphs[0].pool()
            bk.counter.zero_()  # the warm-up runs advanced the device's count
        return pool

    def _run_segments(self, bk: _Bucket, live: ForwardBatch | None, capture=None) -> None:
        """All segments of bucket `bk`: captured (`capture` = (stream, pool)), replayed (`bk.graphs` set) or run
        as plain calls. `live`: the real batch's ForwardBatch, for eager attention (piecewise)."""
        graph_index = 0
        for k, seg in enumerate(self.segments):
            if not seg.graphed:
                self._eager(seg, bk, live)
                continue
            if capture is not None:
                graph = torch.cuda.CUDAGraph()
                stream, pool = capture
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._graph_body(k, seg, bk)
                bk.graphs.append(graph)
                pool = graph.pool()
                capture = (stream, pool)
            elif bk.graphs:
                bk.graphs[graph_index].replay()
            else:
                self._graph_body(k, seg, bk)
            graph_index += 1

    def _graph_body(self, k: int, seg: Segment, bk: _Bucket) -> None:
        n = bk.size
        if k == 0 and self.pull_in_graph:
            self._pull(bk)
        prev_graphed = k > 0 and self.segments[k - 1].graphed
        next_graphed = k + 1 < len(self.segments) and self.segments[k + 1].graphed
        st = {key: bk.handoff[key] if prev_graphed else self.carry[key][:n] for key in seg.reads}
        self.stages.run(seg.ops, st, bk.fb)
        for key in seg.writes:
            if next_graphed:
                bk.handoff[key] = st[key]
            else:
                self.carry[key][:n].copy_(st[key])
        if k == len(self.segments) - 1:
            bk.output = st["logits"] if self.kind == "decode" else st["hidden"]

    def _eager(self, seg: Segment, bk: _Bucket, live: ForwardBatch | None) -> None:
        """Piecewise attention: over the live rows only, with the live batch's metadata; at capture (no live
        batch) nothing runs, the next graph reads the shared buffer as it is."""
        if live is None:
            return
        m = live.num_tokens
        st = {"q": self.carry["q"][:m]}
        self.stages.run(seg.ops, st, live)
        self.carry["a"][:m].copy_(st["a"])

    # --- replay --------------------------------------------------------------------------------------------
    def run(self, spec: BatchSpec, live: ForwardBatch | None = None) -> torch.Tensor:
        """Float32 logits of the spec's logits rows (decode: every row; a view valid until the next replay).
        `live`: for piecewise, the batch built with its attention metadata initialised."""
        m = len(spec.input_ids)
        bk = self.buckets[self.bucket_size(m if self.kind != "decode" else spec.batch_size)]
        slot = bk.turn % _RING
        if bk.read[slot] is not None:
            bk.read[slot].synchronize()  # long done: the replay _RING turns ago read this slot
        self._write(bk, bk.ring[slot].numpy(), spec)
        self._launch(bk, spec.seq_lens if self.kind == "decode" else None, live)
        if self.kind == "decode":
            return bk.output[: spec.batch_size]
        k = len(spec.logits_indices) if spec.logits_indices is not None else m
        rows = bk.static[3 * bk.size : 3 * bk.size + k]
        return self.runner.model.project(bk.output.index_select(0, rows))

    def relaunch(self, bs: int) -> None:
        """Replay the decode graph of `bs` rows on the inputs of its last replay (benchmarks: the launch alone).
        A bare `graphs[...].replay()` would put the host's count of replays out of step with the device's."""
        bk = self.buckets[self.bucket_size(bs)]
        slot = bk.turn % _RING
        if bk.read[slot] is not None:
            bk.read[slot].synchronize()
        bk.ring[slot].copy_(bk.ring[(bk.turn - 1) % _RING])
        with torch.inference_mode():
            self._launch(bk, None, None)

    def _launch(self, bk: _Bucket, seq_lens: list[int] | None, live: ForwardBatch | None) -> None:
        turn = bk.turn
        try:
            if not self.pull_in_graph:
                self._pull(bk)
                if seq_lens is not None:
                    bk.fb.seq_lens_cpu = list(seq_lens) + [1] * (bk.size - len(seq_lens))
                self.backend.init_forward_metadata_replay(bk.size, bk.fb)
            self._run_segments(bk, live)
        except BaseException:
            # However far this replay got, the next one must read the next slot: a count out of step would
            # have every later replay of this bucket read an earlier step's inputs.
            bk.counter[0].fill_(turn + 1)
            bk.counter[1].zero_()
            bk.turn = turn + 1
            raise
        bk.turn = turn + 1
        if self.cuda:
            event = bk.read[turn % _RING] or torch.cuda.Event()
            event.record()
            bk.read[turn % _RING] = event


class GraphRunner:
    """The graphs a model runner replays: decode up to `decode_max_bs`, extend per `extend` mode up to
    `extend_max_tokens` tokens (auto: whole graphs where the attention backend can, piecewise for the batches
    they have no room for; else piecewise)."""

    def __init__(self, runner: ModelRunner, decode_max_bs: int | None, extend: ExtendGraphMode, extend_max_tokens: int):
        self.runner = runner
        backend = runner.attn_backend
        can_whole = getattr(backend, "supports_extend_graph", False)
        if extend == "whole" and not can_whole:
            raise ValueError(
                f"--extend-cuda-graph whole needs an attention backend whose extend attention runs "
                f"without a host plan (triton), not {runner.attn_backend_name}"
            )
        cfg = runner.config
        rows = max(extend_max_tokens if extend != "off" else 0, decode_max_bs or 0)
        dt, dev = runner.dtype, runner.device
        carry = {
            "x": torch.zeros(rows, cfg.hidden_size, dtype=dt, device=dev),
            "residual": torch.zeros(rows, cfg.hidden_size, dtype=dt, device=dev),
            "q": torch.zeros(rows, cfg.num_heads, cfg.head_dim, dtype=dt, device=dev),
            "a": torch.zeros(rows, cfg.num_heads * cfg.head_dim, dtype=dt, device=dev),
        }
        ext = buckets(EXTEND_MIN_BUCKET, extend_max_tokens) if extend != "off" else []
        self.decode = (
            GraphSet("decode", runner, buckets(1, decode_max_bs), carry)
            if decode_max_bs and backend.supports_cuda_graph
            else None
        )
        self.whole = GraphSet("whole", runner, ext, carry) if ext and can_whole and extend != "piecewise" else None
        self.piecewise = GraphSet("piecewise", runner, ext, carry) if ext and extend != "whole" else None
        self.sets = [s for s in (self.decode, self.whole, self.piecewise) if s is not None]
        if runner.device.type == "cuda":
            self._capture()

    def _capture(self) -> None:
        dev = self.runner.device
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(dev)[0]
        pool = None
        with torch.inference_mode():
            for s in self.sets:
                pool = s.capture(pool)
        torch.cuda.synchronize(dev)
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        kinds = ", ".join(f"{s.kind} {s.sizes[0]}..{s.max_size} ({len(s.sizes)} sizes)" for s in self.sets)
        logger.info("captured CUDA graphs: %s in %.1f s, %.2f GB", kinds, time.perf_counter() - start, used / 1e9)

    def release(self) -> None:
        """Destroy every captured graph now, not whenever the last reference to it goes: NCCL's teardown of a
        communicator waits until every graph that captured its collectives is destroyed (it reclaims their
        persistent plans), so tensor-parallel ranks release their graphs before they leave their groups."""
        cuda = self.runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.runner.device)
        for s in self.sets:
            for bk in s.buckets.values():
                for graph in bk.graphs:
                    graph.reset()
                bk.graphs = []
        self.sets, self.decode, self.whole, self.piecewise = [], None, None, None
        if cuda:
            torch.cuda.synchronize(self.runner.device)

    def run(self, spec: BatchSpec) -> torch.Tensor | None:
        """Logits from the graphs that fit the batch; None when none does (the runner runs it eagerly)."""
        with torch.inference_mode():
            if self.decode is not None and self.decode.fits(spec):
                return self.decode.run(spec)
            if self.whole is not None and self.whole.fits(spec):
                return self.whole.run(spec)
            if self.piecewise is not None and self.piecewise.fits(spec):
                return self.piecewise.run(spec, self.runner.prepare(self.runner.build(spec)))
        return None
