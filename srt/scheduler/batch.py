"""Turn the scheduler's requests into a batch: KV slots, the runner's BatchSpec and SamplingBatchInfo.

A batch is built (and its KV slots allocated, `kv_len` advanced) when it is scheduled, before the device has
run anything: under overlap scheduling the next batch is built while the previous one runs. A request whose
last token is still on the device feeds it as a future id (see forward_batch)."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixlm.srt.layers.sampler import PenaltyInfo, SamplingBatchInfo
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode
from radixlm.srt.scheduler.req import Req
from radixlm.srt.utils import to_device

if TYPE_CHECKING:
    from radixlm.srt.mem_cache.memory_pool import ReqToTokenPool
    from radixlm.srt.model_executor.model_runner import PendingSample


@dataclass(eq=False)
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]
    epochs: list[int]  # each request's epoch when scheduled: results for a later epoch are stale
    slots: torch.Tensor  # host: the KV slots allocated for this batch's new tokens
    spec: BatchSpec
    sample_reqs: list[Req]  # logits rows 0..len-1 are these requests' next-token rows
    sample_pos: list[int]  # index in `reqs` of each sampled request
    finals: list[bool]  # whether the entry completes its request's prompt (else a chunk with more to come)
    lp_reqs: list[tuple[int, int]] = field(default_factory=list)  # (index in reqs, number of prompt logprobs)
    lp_next: list[int] = field(default_factory=list)  # the token each prompt-logprob row scores
    logits: torch.Tensor | None = None
    pending: PendingSample | None = None  # the sampled ids on their way to the host
    future_base: int | None = None  # overlap: where the sampled ids went among the runner's futures
    # overlap: this batch's grammar mask, filling while the step before is processed
    mask_future: concurrent.futures.Future | None = None
    # Speculative verify: each request's draft (its 1 + len(draft) positions are all sampled), the offset of
    # each sampled row past its request's tokens, and the host grammar mask of every row (None: unconstrained).
    drafts: list[list[int]] | None = None
    row_offsets: list[int] | None = None
    verify_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.slots)

    def is_current(self, i: int) -> bool:
        r = self.reqs[i]
        return r.epoch == self.epochs[i] and not r.finished


def decode_input(r: Req) -> int:
    return r.output_ids[-1] if r.pending_ref is None else -(r.pending_ref + 1)


def build_extend(
    batch: list[Req], decode_reqs: list[Req], slots: torch.Tensor, req_pool: ReqToTokenPool
) -> ScheduledBatch:
    """`batch`: requests whose `extend_len` tokens from `kv_len` are computed now; `decode_reqs`: running
    requests riding along with one token each (mixed chunked prefill)."""
    input_ids, positions, seq_lens, prefix_lens, ext_lens, sample_rows, sample_reqs = [], [], [], [], [], [], []
    sample_pos, finals, lp_reqs, lp_rows, lp_next = [], [], [], [], []
    offset = 0
    for i, r in enumerate(batch):
        start, end = r.kv_len, r.kv_len + r.extend_len
        fill = r.fill_ids
        req_pool.write(r.req_pool_idx, start, slots[offset : offset + r.extend_len])
        input_ids += fill[start:end]
        positions += range(start, end)
        seq_lens.append(end)
        prefix_lens.append(start)
        ext_lens.append(r.extend_len)
        if r.wants_input_logprobs() and not r.output_ids:
            if start == 0 and r.logprob_start_len == 0:
                r.input_token_logprobs.append((None, fill[0]))
            lo = max(start, max(r.logprob_start_len, 1) - 1)
            hi = min(end, len(r.input_ids) - 1)
            if hi > lo:
                lp_reqs.append((i, hi - lo))
                lp_rows += [offset + p - start for p in range(lo, hi)]
                lp_next += fill[lo + 1 : hi + 1]
        finals.append(end == len(fill))
        if end == len(fill) and r.max_new_tokens > len(r.output_ids):
            sample_reqs.append(r)
            sample_pos.append(i)
            sample_rows.append(offset + r.extend_len - 1)
        offset += r.extend_len
        r.kv_len = end
    if decode_reqs:
        rows = torch.tensor([r.req_pool_idx for r in decode_reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in decode_reqs], dtype=torch.int64)
        req_pool.write_many(rows, cols, slots[offset:])
        for i, r in enumerate(decode_reqs, start=len(batch)):
            finals.append(True)
            sample_pos.append(i)
            input_ids.append(decode_input(r))
            positions.append(r.kv_len)
            prefix_lens.append(r.kv_len)
            ext_lens.append(1)
            r.kv_len += 1
            seq_lens.append(r.kv_len)
            sample_reqs.append(r)
            sample_rows.append(offset)
            offset += 1
    reqs = batch + decode_reqs
    spec = BatchSpec(
        ForwardMode.EXTEND,
        input_ids,
        positions,
        [r.req_pool_idx for r in reqs],
        seq_lens,
        slots,
        logits_indices=(sample_rows + lp_rows) or [offset - 1],
        extend_prefix_lens=prefix_lens,
        extend_seq_lens=ext_lens,
    )
    return ScheduledBatch(
        ForwardMode.EXTEND,
        reqs,
        ext_lens,
        [r.epoch for r in reqs],
        slots,
        spec,
        sample_reqs,
        sample_pos,
        finals,
        lp_reqs,
        lp_next,
    )


def build_verify(
    reqs: list[Req], drafts: list[list[int]], slots: torch.Tensor, req_pool: ReqToTokenPool
) -> ScheduledBatch:
    """Speculative verify: each running request computes its last token and its draft in one extend, and every
    one of those positions is sampled (row j of a request predicts the token after its j-th draft token)."""
    input_ids, positions, seq_lens, prefix_lens, ext_lens, sample_pos, offsets = [], [], [], [], [], [], []
    rows = []  # each position's request row: the slots go into the table in one write (one device copy)
    offset = 0
    for i, (r, d) in enumerate(zip(reqs, drafts)):
        n = 1 + len(d)
        start = r.kv_len
        rows += [r.req_pool_idx] * n
        input_ids += [decode_input(r), *d]
        positions += range(start, start + n)
        prefix_lens.append(start)
        ext_lens.append(n)
        r.kv_len = start + n
        seq_lens.append(r.kv_len)
        sample_pos += [i] * n
        offsets += range(n)
        offset += n
    req_pool.write_many(torch.tensor(rows, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), slots)
    spec = BatchSpec(
        ForwardMode.EXTEND,
        input_ids,
        positions,
        [r.req_pool_idx for r in reqs],
        seq_lens,
        slots,
        logits_indices=list(range(offset)),
        extend_prefix_lens=prefix_lens,
        extend_seq_lens=ext_lens,
    )
    return ScheduledBatch(
        ForwardMode.EXTEND,
        list(reqs),
        ext_lens,
        [r.epoch for r in reqs],
        slots,
        spec,
        [reqs[i] for i in sample_pos],
        sample_pos,
        [True] * len(reqs),
        drafts=drafts,
        row_offsets=offsets,
    )


def build_decode(reqs: list[Req], slots: torch.Tensor, req_pool: ReqToTokenPool) -> ScheduledBatch:
    rows = [r.req_pool_idx for r in reqs]
    cols = [r.kv_len for r in reqs]
    req_pool.write_many(torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64), slots)
    for r in reqs:
        r.kv_len += 1
    spec = BatchSpec(ForwardMode.DECODE, [decode_input(r) for r in reqs], cols, rows, [c + 1 for c in cols], slots)
    n = len(reqs)
    return ScheduledBatch(
        ForwardMode.DECODE,
        list(reqs),
        [1] * n,
        [r.epoch for r in reqs],
        slots,
        spec,
        list(reqs),
        list(range(n)),
        [True] * n,
    )


def sampling_info(
    reqs: list[Req], vocab_size: int, device: torch.device, offsets: list[int] | None = None
) -> SamplingBatchInfo:
    """`offsets`: per row, how many tokens past its request's current ones the row samples (speculative verify:
    the seeded noise and min_new_tokens are those of that later step)."""
    ps = [r.sampling_params for r in reqs]
    greedy = [p.is_greedy for p in ps]
    # each row's step: the seeded noise's and min_new_tokens' (a greedy batch without min_new_tokens needs neither)
    steps = []
    if not all(greedy) or any(p.min_new_tokens for p in ps):
        steps = [r.produced() for r in reqs] if offsets is None else [r.produced() + o for r, o in zip(reqs, offsets)]

    def f(values, dtype=torch.float32):
        return to_device(torch.tensor(values, dtype=dtype), device)

    info = SamplingBatchInfo(
        temperatures=None,
        top_ps=None,
        top_ks=None,
        min_ps=None,
        seeds=None,
        steps=None,
        greedy=None,
        all_greedy=all(greedy),
        need_top_k_p=False,
        need_min_p=False,
        return_logprob=any(r.return_logprob for r in reqs),
        top_logprobs_num=max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0),
    )
    if not info.all_greedy:  # the common all-greedy batch needs none of these on the device
        top_ks = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
        floats = f([[1.0 if g else p.temperature, p.top_p, p.min_p] for p, g in zip(ps, greedy)])
        ints = f([[k, r.seed, n, g] for k, r, n, g in zip(top_ks, reqs, steps, greedy)], torch.int64)
        info.temperatures, info.top_ps, info.min_ps = floats[:, 0:1], floats[:, 1], floats[:, 2]
        info.top_ks, info.seeds, info.steps, info.greedy = ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3].bool()
        info.need_top_k_p = any(p.top_p < 1.0 or k < vocab_size for p, k, g in zip(ps, top_ks, greedy) if not g)
        info.need_min_p = any(p.min_p > 0 for p, g in zip(ps, greedy) if not g)
    if any(p.has_penalties() for p in ps):
        info.penalties = _penalties(reqs, vocab_size, device)
    # Sparse entries go to the device and are scattered there: a dense [B, V] host tensor per step would
    # cost a memset and a transfer of B * V floats.
    banned = [
        (i, t)
        for i, r in enumerate(reqs)
        if steps and steps[i] < r.sampling_params.min_new_tokens
        for t in r.stop_token_ids
        if t < vocab_size
    ]
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
    counts = torch.zeros(len(reqs), vocab_size + 1, device=device).scatter_add_(
        1, out, torch.ones_like(out, dtype=torch.float32)
    )
    prompt = _padded([r.input_ids for r in reqs], vocab_size).to(device)
    seen = torch.zeros(len(reqs), vocab_size + 1, dtype=torch.bool, device=device).scatter_(1, prompt, True)
    seen = seen[:, :vocab_size] | (counts[:, :vocab_size] > 0)

    def col(name):
        return torch.tensor([[getattr(r.sampling_params, name)] for r in reqs], dtype=torch.float32, device=device)

    return PenaltyInfo(
        frequency=col("frequency_penalty"),
        presence=col("presence_penalty"),
        repetition=col("repetition_penalty"),
        output_counts=counts[:, :vocab_size],
        seen=seen,
    )
