"""Turn the scheduler's requests into the model's tensors: ForwardBatch and SamplingBatchInfo."""
from __future__ import annotations

import torch

from radixlm.srt.layers.sampler import PenaltyInfo, SamplingBatchInfo
from radixlm.srt.managers.req import Req


def sampling_info(reqs: list[Req], vocab_size: int, device: torch.device) -> SamplingBatchInfo:
    ps = [r.sampling_params for r in reqs]
    greedy = [p.is_greedy for p in ps]

    def f(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
    info = SamplingBatchInfo(
        temperatures=f([[1.0 if g else p.temperature] for p, g in zip(ps, greedy)]),
        top_ps=f([p.top_p for p in ps]),
        top_ks=f(top_ks, torch.int64),
        min_ps=f([p.min_p for p in ps]),
        seeds=f([r.seed for r in reqs], torch.int64),
        steps=f([len(r.output_ids) for r in reqs], torch.int64),
        greedy=f(greedy, torch.bool),
        all_greedy=all(greedy),
        need_top_k_p=any(p.top_p < 1.0 or k < vocab_size for p, k, g in zip(ps, top_ks, greedy) if not g),
        need_min_p=any(p.min_p > 0 for p, g in zip(ps, greedy) if not g),
        return_logprob=any(r.return_logprob for r in reqs),
        top_logprobs_num=max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0),
    )
    if any(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 for p in ps):
        info.penalties = _penalties(reqs, vocab_size, device)
    # Sparse entries go to the device and are scattered there: a dense [B, V] host tensor per step would
    # cost a memset and a transfer of B * V floats.
    banned = [(i, t) for i, r in enumerate(reqs) if len(r.output_ids) < r.sampling_params.min_new_tokens
              for t in r.stop_token_ids if t < vocab_size]
    if banned:
        rows, cols = zip(*banned)
        info.banned = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=device)
        info.banned[f(rows, torch.int64), f(cols, torch.int64)] = True
    biased = [(i, t, v) for i, p in enumerate(ps) if p.logit_bias for t, v in p.logit_bias.items() if t < vocab_size]
    if biased:
        rows, cols, vals = zip(*biased)
        info.bias = torch.zeros(len(reqs), vocab_size, device=device)
        info.bias[f(rows, torch.int64), f(cols, torch.int64)] = f(vals)
    return info


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


def _penalties(reqs: list[Req], vocab_size: int, device: torch.device) -> PenaltyInfo:
    # An extra column swallows the padding; it is cut off below.
    out = _padded([r.output_ids for r in reqs], vocab_size).to(device)
    counts = torch.zeros(len(reqs), vocab_size + 1, device=device).scatter_add_(1, out, torch.ones_like(out, dtype=torch.float32))
    prompt = _padded([r.input_ids for r in reqs], vocab_size).to(device)
    seen = torch.zeros(len(reqs), vocab_size + 1, dtype=torch.bool, device=device).scatter_(1, prompt, True)
    seen = seen[:, :vocab_size] | (counts[:, :vocab_size] > 0)

    def col(name):
        return torch.tensor([[getattr(r.sampling_params, name)] for r in reqs], dtype=torch.float32, device=device)

    return PenaltyInfo(frequency=col("frequency_penalty"), presence=col("presence_penalty"),
                       repetition=col("repetition_penalty"), output_counts=counts[:, :vocab_size], seen=seen)
