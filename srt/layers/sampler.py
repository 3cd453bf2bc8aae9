"""Batched sampling on device: penalties, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Randomness is counter-based: the noise for (request seed, step, token) is a hash, so a request samples the
same tokens whatever batch it runs in, and after a retraction it regenerates exactly what it had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.srt.constrained.bitmask import apply_bitmask

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply) on int64 tensors holding values < 2**32."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from a 64-bit seed and the number of tokens generated so far."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    return _mix32(_mix32(lo ^ _mix32(hi)) ^ (steps & _M32))


@dataclass
class PenaltyInfo:
    frequency: torch.Tensor  # [B, 1]
    presence: torch.Tensor  # [B, 1]
    repetition: torch.Tensor  # [B, 1]
    output_counts: torch.Tensor  # [B, V] float: how often each token was generated
    seen: torch.Tensor  # [B, V] bool: token appeared in prompt or output


@dataclass
class SamplingBatchInfo:
    # Per-row tensors; None when every row is greedy (all_greedy), which needs none of them.
    temperatures: torch.Tensor | None  # [B, 1]; greedy rows hold 1.0
    top_ps: torch.Tensor | None  # [B]
    top_ks: torch.Tensor | None  # [B] int64, vocab size where off
    min_ps: torch.Tensor | None  # [B]
    seeds: torch.Tensor | None  # [B] int64
    steps: torch.Tensor | None  # [B] int64
    greedy: torch.Tensor | None  # [B] bool
    all_greedy: bool
    need_top_k_p: bool
    need_min_p: bool
    penalties: PenaltyInfo | None = None
    banned: torch.Tensor | None = None  # [B, V] bool: tokens forbidden this step (min_new_tokens)
    bias: torch.Tensor | None = None  # [B, V] float added to the logits (logit_bias)
    top_logprobs_num: int = 0
    return_logprob: bool = False
    vocab_mask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32 bitmask of grammar-allowed tokens


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def _row_argmax(device: torch.device):
    """Our two-pass kernel on CUDA (kernels/argmax.py: several times faster than torch's at batch 1), else
    torch's argmax."""
    from radixlm.kernels import HAS_TRITON

    if device.type == "cuda" and HAS_TRITON:
        from radixlm.kernels.argmax import argmax

        return argmax
    return lambda x: x.argmax(-1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.col_keys = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ 0x9E3779B9)
        self.argmax = _row_argmax(device)

    @torch.inference_mode()
    def warmup(self, dtype: torch.dtype) -> None:
        """Compile the argmax kernel for the logits it will see: the model's dtype and float32 (what logit_bias,
        penalties and grammar masks promote logits to). Otherwise the first request of each kind paid for a
        Triton compile (about a second)."""
        for d in {dtype, torch.float32}:
            self.argmax(torch.zeros(2, self.vocab_size, dtype=d, device=self.col_keys.device))

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """Sample and read the result back (one synchronous transfer)."""
        ids = self.sample_ids(logits, info)
        return unpack_sample(self.result_columns(logits, ids, info).view(-1).cpu(), ids.shape[0], info)

    @torch.inference_mode()
    def sample_ids(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The next token of every row, on the device; never syncs with the host."""
        if info.penalties is not None:
            logits = apply_penalties(logits, info.penalties)
        if info.bias is not None:
            logits = logits + info.bias
        if info.banned is not None:
            logits = logits.masked_fill(info.banned, float("-inf"))
        if info.vocab_mask is not None:  # last: a grammar's choice overrides min_new_tokens' EOS ban
            logits = apply_bitmask(logits, info.vocab_mask)
        greedy_ids = self.argmax(logits)
        if info.all_greedy:
            return greedy_ids
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_top_k_p:
            probs = top_k_top_p(probs, info.top_ks, info.top_ps)
        if info.need_min_p:
            floor = probs.max(-1, keepdim=True).values * info.min_ps[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        return torch.where(info.greedy, greedy_ids, self._race(probs, info))

    @staticmethod
    def result_columns(raw: torch.Tensor, ids: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """[B, cols] float64 (exact for token ids): id, then logprob and top-k ids and logprobs if asked, so
        that everything a step returns comes back in one transfer. Logprobs are of the unmodified logits."""
        cols = [ids.double()[:, None]]
        if info.return_logprob:
            lp = torch.log_softmax(raw, dim=-1)
            cols.append(lp.gather(1, ids[:, None]).double())
            if info.top_logprobs_num:
                top = lp.topk(info.top_logprobs_num, dim=-1)
                cols += [top.indices.double(), top.values.double()]
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)

    def _race(self, probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Sample each row from `probs` via the exponential race argmax(p / E), E ~ Exp(1) from the hash."""
        keys = row_keys(info.seeds, info.steps)
        bits = _mix32(keys[:, None] ^ self.col_keys[None, :])
        uniform = (bits.double() + 0.5) * (1.0 / 4294967296.0)
        exp = -torch.log(uniform)
        return (probs.double() / exp).argmax(-1)


def apply_penalties(logits: torch.Tensor, p: PenaltyInfo) -> torch.Tensor:
    # Repetition (HF/vLLM semantics) over prompt + output; frequency/presence (OpenAI semantics) over output.
    logits = torch.where(p.seen, torch.where(logits > 0, logits / p.repetition, logits * p.repetition), logits)
    return logits - p.frequency * p.output_counts - p.presence * (p.output_counts > 0).to(logits.dtype)


def top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    # Keep the smallest head whose mass reaches top_p (the first token always survives) and at most top_k.
    drop = ((cum - sorted_p) >= top_ps[:, None]) | (ranks >= top_ks[:, None])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def unpack_sample(flat: torch.Tensor, n: int, info: SamplingBatchInfo) -> SampleOutput:
    """The host side of `result_columns`: `flat` holds its [n, cols] block first."""
    k = info.top_logprobs_num if info.return_logprob else 0
    width = 1 + (1 + 2 * k if info.return_logprob else 0)
    host = flat[: n * width].view(n, width)
    out = SampleOutput(next_ids=host[:, 0].long().tolist(), logprobs=None, top_ids=None, top_logprobs=None)
    if info.return_logprob:
        out.logprobs = host[:, 1].tolist()
        if k:
            out.top_ids = host[:, 2 : 2 + k].long().tolist()
            out.top_logprobs = host[:, 2 + k :].tolist()
    return out
