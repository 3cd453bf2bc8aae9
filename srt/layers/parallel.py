"""The sharded layers of a tensor-parallel model. With one rank each is exactly its plain counterpart."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.srt.distributed.parallel import SINGLE, PartialSum, TensorParallel
from radixlm.srt.layers.basic import Embedding, Linear


class RowParallelLinear(Linear):
    """A projection whose input features are split across ranks (o and down): each rank's partial product is
    summed by one all-reduce, and the bias is added once, after it. With `feeds_norm` (its output goes into an
    RMSNorm and nowhere else) and no bias, it returns the PartialSum and the norm takes the all-reduce into its
    kernel (srt/distributed/fused_all_reduce.py)."""

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
        if self.feeds_norm and self.bias is None:
            return PartialSum(self.product(x), self.tp)
        y = self.tp.all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias


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
