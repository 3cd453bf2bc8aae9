"""The scheduler core: a plain object that steps. `add(req)`, `abort(rid)`, `step() -> outputs`.

Each step runs either an extend batch (new requests and chunks of long prompts, admitted in policy order while
KV memory allows) or a decode batch of every running request. Requests that share a prefix reuse its KV through
the radix cache; when decode runs out of KV, the least advanced requests are retracted to the waiting queue.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass

import torch

from radixlm.srt.managers.io_struct import TokenOutput
from radixlm.srt.managers.req import Req
from radixlm.srt.managers.request_prep import check_request_limits
from radixlm.srt.managers.schedule_batch import sampling_info
from radixlm.srt.managers.schedule_policy import SchedulePolicy
from radixlm.srt.mem_cache.radix_cache import ChunkCache, RadixCache
from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


class BatchFailed(Exception):
    """A batch failed on the device; its requests were aborted with an error (see _fail_batch_on_oom)."""

CLIP_MAX_NEW_TOKENS = 4096  # cap on the decode growth one request is assumed to need at admission
INIT_NEW_TOKEN_RATIO = 0.7  # assumed fraction of max_new_tokens a request will really generate
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
IN_BATCH_PREFIX_MIN = 32  # defer a request that shares at least this many uncached tokens with one admitted now


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which served from the radix cache at first admission
    computed_prefill_tokens: int = 0  # tokens run through extend (including re-prefills after retraction)
    generated_tokens: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    retractions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    busy_seconds: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    def __init__(self, runner, tokenizer, args):
        self.runner = runner
        self.tokenizer = tokenizer
        self.context_length = runner.context_length
        self.kv_pool = runner.token_to_kv_pool
        self.req_pool = runner.req_to_token_pool
        self.tree_cache = ChunkCache(self.kv_pool) if args.disable_radix_cache else RadixCache(self.kv_pool)
        self.policy = SchedulePolicy(args.schedule_policy, self.tree_cache, args.random_seed)
        self.max_running = runner.max_running_requests
        chunk = args.chunked_prefill_size
        if chunk is None:
            chunk = 8192 if runner.device.type == "cuda" else 1024
        self.chunk_size = None if chunk <= 0 else chunk
        self.max_prefill_tokens = args.max_prefill_tokens
        self.conservativeness = args.schedule_conservativeness
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self.last_step: dict = {}
        self._outputs: list[TokenOutput] = []

    # --- public interface ----------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.validate(req)
        self.waiting.append(req)

    def validate(self, req: Req) -> None:
        """Check a request against the model and memory limits and resolve its max_new_tokens."""
        req.max_new_tokens = check_request_limits(req.input_ids, req.sampling_params,
                                                  self.context_length, self.kv_pool.size, self.runner.vocab_size)

    def abort(self, rid: str, notify: bool = True) -> bool:
        """Stop a request wherever it is; its slots and locks are returned at once. With `notify`, the next
        step reports it finished with reason `abort`."""
        for queue in (self.waiting, self.running):
            for r in queue:
                if r.rid == rid:
                    queue.remove(r)
                    self._finish_abort(r, notify)
                    return True
        if self.chunked is not None and self.chunked.rid == rid:
            r, self.chunked = self.chunked, None
            self._finish_abort(r, notify)
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._outputs)

    def step(self) -> list[TokenOutput]:
        start = time.perf_counter()
        outputs, self._outputs = self._outputs, []
        batch = self._schedule_extend()
        if not batch and not self.running:
            return outputs
        try:
            outputs += self._run_extend(batch) if batch else self._run_decode()
        except BatchFailed:  # its requests were aborted with an error; report them now
            outputs += self._outputs
            self._outputs = []
        self.stats.busy_seconds += time.perf_counter() - start
        return outputs

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while requests are in flight."""
        if self.waiting or self.running or self.chunked:
            return False
        return self.tree_cache.flush()

    def get_stats(self) -> dict:
        s = asdict(self.stats)
        s.update(cache_hit_rate=self.stats.cache_hit_rate, num_running=len(self.running) + (self.chunked is not None),
                 num_waiting=len(self.waiting), kv_total=self.kv_pool.size, kv_free=self.kv_pool.available_size(),
                 kv_cached=self.tree_cache.total_size(), kv_evictable=self.tree_cache.evictable_size(),
                 evicted_tokens=self.tree_cache.evicted_tokens,
                 gen_throughput=self.stats.generated_tokens / self.stats.busy_seconds if self.stats.busy_seconds else 0.0,
                 new_token_ratio=self.new_token_ratio, last_step=self.last_step)
        s["kv_used"] = s["kv_total"] - s["kv_free"] - s["kv_evictable"]
        return s

    def check_invariants(self) -> None:
        """Every slot is free, in the tree, or private to exactly one running request (tests call this)."""
        active = self.running + ([self.chunked] if self.chunked else [])
        private = sum(r.kv_len - len(r.prefix_slots) for r in active)
        total = self.kv_pool.available_size() + self.tree_cache.total_size() + private
        assert total == self.kv_pool.size, f"slot leak: free+cached+private={total} != {self.kv_pool.size}"
        assert len(torch.unique(self.kv_pool.free_slots())) == self.kv_pool.available_size(), "slot freed twice"
        assert self.req_pool.available_size() + len(active) == self.req_pool.size, "request row leak"

    # --- admission -------------------------------------------------------------------------------------------
    def _decode_reserve(self, r: Req) -> float:
        left = min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
        return left * self.new_token_ratio * self.conservativeness

    def _room(self, reserved: float) -> float:
        return self.kv_pool.available_size() + self.tree_cache.evictable_size() - reserved

    def _schedule_extend(self) -> list[Req]:
        if not self.waiting and self.chunked is None:
            return []
        budget = min(self.max_prefill_tokens, self.chunk_size or self.max_prefill_tokens)
        reserved = sum(self._decode_reserve(r) for r in self.running)
        batch: list[Req] = []
        if self.chunked is not None:
            r = self.chunked
            left = len(r.fill_ids) - r.kv_len
            n = int(min(left, budget, self._room(reserved)))
            if n <= 0:
                return []
            r.extend_len = n
            batch.append(r)
            if n < left:
                return batch
            self.chunked = None
            budget -= n
            reserved += n + self._decode_reserve(r)
        if budget <= 0 or not self.waiting:
            return batch
        is_radix = isinstance(self.tree_cache, RadixCache)
        for r in self.policy.order(self.waiting):
            if len(self.running) + len(batch) >= self.max_running or self.req_pool.available_size() == 0:
                break
            limit = len(r.fill_ids) - 1  # the last token is always computed: its logits are needed
            if r.wants_input_logprobs() and not r.output_ids:
                limit = min(limit, max(r.logprob_start_len - 1, 0))
            self.tree_cache.match_req(r, limit)
            prefix = len(r.prefix_slots)
            if is_radix and self._shares_with_batch(r, prefix, batch):
                self._unlock(r)  # its prefix will be cached once the batch runs; take it next step
                continue
            extend = len(r.fill_ids) - prefix
            reserve = self._decode_reserve(r)
            room = self._room(reserved)
            if extend + reserve > room and (batch or self.running or extend > room):
                self._unlock(r)
                break
            self.waiting.remove(r)
            batch.append(r)
            if extend > budget and self.chunk_size is not None:
                r.extend_len = budget
                self.chunked = r
                break
            r.extend_len = extend
            budget -= extend
            reserved += extend + reserve
            if budget <= 0:
                break
        return batch

    def _shares_with_batch(self, r: Req, prefix: int, batch: list[Req]) -> bool:
        ids = r.fill_ids
        for other in batch:
            o = other.fill_ids
            n = min(len(ids), len(o)) - 1
            i = prefix
            while i < n and ids[i] == o[i]:
                i += 1
            if i - prefix >= IN_BATCH_PREFIX_MIN:
                return True
        return False

    def _unlock(self, r: Req) -> None:
        """Give back a prefix matched at admission by a request that is not admitted after all."""
        if r.last_node is not None:
            self.tree_cache.dec_lock_ref(r.last_node)
        r.prefix_slots, r.last_node = torch.empty(0, dtype=torch.int64), None

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.kv_pool.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        slots = self.kv_pool.alloc(n)
        if slots is None:
            raise RuntimeError(f"KV cache exhausted: need {n} slots, {self.kv_pool.available_size()} free")
        return slots

    # --- extend --------------------------------------------------------------------------------------------
    def _run_extend(self, batch: list[Req]) -> list[TokenOutput]:
        for r in batch:
            if r.req_pool_idx is None:
                r.req_pool_idx = self.req_pool.alloc()
                r.kv_len = len(r.prefix_slots)
                self.req_pool.write(r.req_pool_idx, 0, r.prefix_slots)
            if not r.admitted:
                r.admitted = True
                r.cached_tokens = len(r.prefix_slots)
                self.stats.prompt_tokens += len(r.input_ids)
                self.stats.cached_tokens += r.cached_tokens
        total = sum(r.extend_len for r in batch)
        slots = self._alloc(total)
        input_ids, positions, seq_lens, prefix_lens, logits_rows = [], [], [], [], []
        sample_reqs, sample_rows, lp_reqs, lp_rows, lp_next = [], [], [], [], []
        offset = 0
        for r in batch:
            start, end = r.kv_len, r.kv_len + r.extend_len
            fill = r.fill_ids
            self.req_pool.write(r.req_pool_idx, start, slots[offset : offset + r.extend_len])
            input_ids += fill[start:end]
            positions += range(start, end)
            seq_lens.append(end)
            prefix_lens.append(start)
            if r.wants_input_logprobs() and not r.output_ids:
                if start == 0 and r.logprob_start_len == 0:
                    r.input_token_logprobs.append((None, fill[0]))
                lo = max(start, max(r.logprob_start_len, 1) - 1)
                hi = min(end, len(r.input_ids) - 1)
                if hi > lo:
                    lp_reqs.append((r, hi - lo))
                    for p in range(lo, hi):
                        lp_rows.append(len(logits_rows))
                        logits_rows.append(offset + p - start)
                        lp_next.append(fill[p + 1])
            if end == len(fill) and r.max_new_tokens > len(r.output_ids):
                sample_reqs.append(r)
                sample_rows.append(len(logits_rows))
                logits_rows.append(offset + r.extend_len - 1)
            offset += r.extend_len
        fb = ForwardBatch.build(ForwardMode.EXTEND, self.runner.device, input_ids=input_ids, positions=positions,
                                req_pool_indices=[r.req_pool_idx for r in batch], seq_lens=seq_lens,
                                out_cache_loc=slots, logits_indices=logits_rows or [offset - 1],
                                extend_prefix_lens=prefix_lens, extend_seq_lens=[r.extend_len for r in batch])
        with self._fail_batch_on_oom(batch, slots):
            logits = self.runner.forward(fb)
            sampled = None
            if sample_reqs:
                rows = torch.tensor(sample_rows, device=logits.device)
                sampled = self.runner.sample(logits[rows],
                                             sampling_info(sample_reqs, self.runner.vocab_size, logits.device))
            if lp_rows:
                self._collect_input_logprobs(logits, lp_rows, lp_next, lp_reqs)
        self.stats.extend_steps += 1
        self.stats.computed_prefill_tokens += total
        self.last_step = {"mode": "extend", "batch_size": len(batch), "tokens": total}
        outputs = []
        sample_index = {id(r): i for i, r in enumerate(sample_reqs)}
        for r in batch:
            r.kv_len += r.extend_len
            if r.kv_len < len(r.fill_ids):  # more chunks to come
                self._publish_prefix(r)
                continue
            i = sample_index.get(id(r))
            if i is None:  # max_new_tokens == 0: prefill only
                r.finished_reason = {"type": "length", "length": len(r.output_ids)}
                outputs.append(self._output(r, []))
                self._release(r)
                continue
            outputs.append(self._append_token(r, sampled, i))
            if r.finished:
                self._release(r)
            else:
                self._publish_prefix(r)
                self.running.append(r)
        return outputs

    def _collect_input_logprobs(self, logits, rows, next_ids, lp_reqs) -> None:
        lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
        values = lp.gather(1, torch.tensor(next_ids, device=logits.device)[:, None]).squeeze(1).tolist()
        pos = 0
        for r, n in lp_reqs:
            r.input_token_logprobs += list(zip(values[pos : pos + n], next_ids[pos : pos + n]))
            pos += n

    def _publish_prefix(self, r: Req) -> None:
        """Put the request's computed tokens into the tree so others can share them while it runs."""
        self.tree_cache.cache_unfinished_req(r, self.req_pool.slots(r.req_pool_idx, r.kv_len))
        self.req_pool.write(r.req_pool_idx, 0, r.prefix_slots)

    # --- decode --------------------------------------------------------------------------------------------
    def _run_decode(self) -> list[TokenOutput]:
        self._make_decode_room()
        reqs = self.running
        n = len(reqs)
        slots = self._alloc(n)
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.req_pool.write_many(rows, cols, slots)
        fb = ForwardBatch.build(ForwardMode.DECODE, self.runner.device, input_ids=[r.output_ids[-1] for r in reqs],
                                positions=cols.tolist(), req_pool_indices=rows.tolist(),
                                seq_lens=[r.kv_len + 1 for r in reqs], out_cache_loc=slots,
                                logits_indices=list(range(n)))
        with self._fail_batch_on_oom(reqs, slots):
            logits = self.runner.forward(fb)
            sampled = self.runner.sample(logits, sampling_info(reqs, self.runner.vocab_size, logits.device))
        outputs = []
        for i, r in enumerate(reqs):
            r.kv_len += 1
            outputs.append(self._append_token(r, sampled, i))
            if r.finished:
                self._release(r)
        self.running = [r for r in reqs if not r.finished]
        self.stats.decode_steps += 1
        self.last_step = {"mode": "decode", "batch_size": n, "tokens": n}
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return outputs

    @contextlib.contextmanager
    def _fail_batch_on_oom(self, reqs: list[Req], slots: torch.Tensor):
        """A batch that runs out of device memory fails its own requests (503) and frees what they held; the
        scheduler and every other request go on."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            logger.error("out of device memory in a batch of %d requests; failing them: %s", len(reqs), e)
            self.kv_pool.free(slots)  # this step's slots: not yet counted in any request's kv_len
            for r in list(reqs):  # for a decode batch, `reqs` is self.running itself
                if self.chunked is r:
                    self.chunked = None
                if r in self.running:
                    self.running.remove(r)
                self._finish_abort(r, notify=True, message="the server ran out of device memory running this "
                                   "request; retry it or send a shorter one", status_code=503)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise BatchFailed(f"{len(reqs)} requests failed") from e

    def _make_decode_room(self) -> None:
        """Evict cached prefixes, then retract the least advanced requests, until every runner has a slot."""
        while True:
            short = len(self.running) - self.kv_pool.available_size()
            if short <= 0:
                return
            self.tree_cache.evict(short)
            if self.kv_pool.available_size() >= len(self.running) or len(self.running) == 1:
                return
            victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self._retract(victim)

    def _retract(self, r: Req) -> None:
        self.running.remove(r)
        self._free_kv(r)
        r.retractions += 1
        self.waiting.insert(0, r)
        self.stats.retractions += 1
        # Admission was too optimistic: assume requests need all they asked for, then relax again.
        self.new_token_ratio = 1.0
        logger.debug("retracted %s after %d tokens", r.rid, len(r.output_ids))

    # --- outputs and release -------------------------------------------------------------------------------
    def _append_token(self, r: Req, sampled, i: int) -> TokenOutput:
        token = sampled.next_ids[i]
        r.output_ids.append(token)
        self.stats.generated_tokens += 1
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        lp = top = None
        if r.return_logprob:
            lp = [(sampled.logprobs[i], token)]
            r.output_token_logprobs += lp
            if r.top_logprobs_num:
                k = r.top_logprobs_num
                top = [list(zip(sampled.top_logprobs[i][:k], sampled.top_ids[i][:k]))]
                r.output_top_logprobs += top
        r.check_finished(self.tokenizer, self.context_length)
        return self._output(r, [token], lp, top)

    def _output(self, r: Req, new_ids: list[int], lp=None, top=None) -> TokenOutput:
        out = TokenOutput(rid=r.rid, new_ids=new_ids, prompt_tokens=len(r.input_ids),
                          completion_tokens=len(r.output_ids), cached_tokens=r.cached_tokens,
                          finished_reason=r.finished_reason, output_logprobs=lp, output_top_logprobs=top)
        if not r.detok_sent:
            p = r.sampling_params
            out.detok = {"skip_special_tokens": p.skip_special_tokens, "stop": p.stop, "no_stop_trim": p.no_stop_trim,
                         "spaces_between_special_tokens": p.spaces_between_special_tokens}
            r.detok_sent = True
        if r.input_token_logprobs and not r.input_logprobs_sent:
            out.input_logprobs = r.input_token_logprobs
            r.input_logprobs_sent = True
        return out

    def _free_kv(self, r: Req) -> None:
        if r.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(r, self.req_pool.slots(r.req_pool_idx, r.kv_len))
            self.req_pool.free(r.req_pool_idx)
            r.req_pool_idx = None
        elif r.last_node is not None:
            self._unlock(r)
        r.kv_len = 0

    def _release(self, r: Req) -> None:
        self._free_kv(r)
        self.stats.finished_requests += 1

    def _finish_abort(self, r: Req, notify: bool, message: str = "request aborted",
                      status_code: int | None = None) -> None:
        self._free_kv(r)
        r.finished_reason = {"type": "abort", "message": message}
        if status_code is not None:  # a failure, not a client's abort: the HTTP layer answers with this status
            r.finished_reason["status_code"] = status_code
        self.stats.aborted_requests += 1
        if notify:
            self._outputs.append(self._output(r, []))
