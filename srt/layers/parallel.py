"""The sharded layers of a tensor-parallel model. With one rank each is exactly its plain counterpart."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from radixlm.srt.distributed.parallel import SINGLE, PartialSum, TensorParallel
from radixlm.srt.layers.basic import Embedding, Linear

# A pipelined projection's pieces: at most this many, each of at least PIECE_ROWS rows (smaller GEMMs lose
# efficiency; more pieces leave less of the last all-reduce exposed).
MAX_PIECES, PIECE_ROWS = 4, 512


class RowParallelLinear(Linear):
    """A projection whose input features are split across ranks (o and down): each rank's partial product is
    summed by one all-reduce, and the bias is added once, after it. With `feeds_norm` (its output goes into an
    RMSNorm and nowhere else) and no bias, it returns the PartialSum and the norm takes the all-reduce into its
    kernel (srt/distributed/fused_all_reduce.py). From `tp.overlap_rows` rows (a prefill chunk, outside CUDA
    graph capture) the product runs in row pieces whose all-reduces start as each piece is done, so that the
    collective of one piece runs while the next is computed: only the last piece's all-reduce is left exposed."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
        feeds_norm: bool = False,
    ):
        super().__init__(in_features, out_features, bias)
        self.tp = tp
        self.feeds_norm = feeds_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSum:
        if self.tp.size == 1:
            return super().forward(x)
        if self._pipelined(x):
            y = self._product_reduced(x)
        elif self.feeds_norm and self.bias is None:
            return PartialSum(self.product(x), self.tp)
        else:
            y = self.tp.all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias

    def _pipelined(self, x) -> bool:
        rows = x.shape[0] if x.dim() == 2 else 0
        if not self.tp.overlap_rows or rows < max(self.tp.overlap_rows, 2 * PIECE_ROWS):
            return False
        # a captured graph replays its own collectives in order; the overlap is for eager prefill steps
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def _product_reduced(self, x) -> torch.Tensor:
        """The all-reduced product of x, computed and reduced in row pieces that overlap (see the class)."""
        pieces = min(MAX_PIECES, x.shape[0] // PIECE_ROWS)
        parts, pending = [], []
        for rows in row_pieces(x, pieces):
            part = self.product(rows)
            pending.append(self.tp.all_reduce_async(part))
            parts.append(part)
        for work in pending:
            work.wait()
        return torch.cat(parts)


def row_pieces(x, pieces: int) -> list:
    """x split into `pieces` runs of rows (the last takes the remainder): tensors, or e4m3 rows with their
    per-token scales (quantization/fp8.py's Fp8Rows) split alike."""
    step = -(-x.shape[0] // pieces)
    starts = range(0, x.shape[0], step)
    if isinstance(x, torch.Tensor):
        return [x[s : s + step] for s in starts]
    return [dataclasses.replace(x, q=x.q[s : s + step], scale=x.scale[s : s + step]) for s in starts]


class VocabParallelEmbedding(Embedding):
    """The embedding table split by vocabulary range (TensorParallel.vocab_range): a rank looks up the ids in its
    range, zeros the others, and one all-reduce assembles every row."""

    def __init__(self, num_embeddings: int, dim: int, tp: TensorParallel = SINGLE):
        self.tp = tp
        self.start, rows, self.real = tp.vocab_range(num_embeddings)
        super().__init__(rows, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.real)
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)
