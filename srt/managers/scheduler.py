"""The scheduler core: a plain object that steps. `add(req)`, `abort(rid)`, `step() -> outputs`.

Each step runs either an extend batch (new requests and chunks of long prompts, admitted in policy order while
KV memory allows; with mixed chunked prefill the running requests' next tokens ride along) or a decode batch of
every running request. Requests that share a prefix reuse its KV through the radix cache; when decode runs out
of KV, the least advanced requests are retracted to the waiting queue.

A step has three phases: schedule (host bookkeeping: admission, radix matching, KV slots, batch tensors),
launch (forward, then sampling and the one device->host copy; nothing waits for the device) and process (read
the sampled tokens back, stream them, finish requests). Without overlap they run in that order. With overlap
scheduling the host schedules and launches step n+1 before it processes step n, so the device never waits for
the host: step n+1 reads step n's tokens straight from the device (futures), a request that finished at step n
rides in step n+1 and its extra token is dropped. Sampling for step n+1 is launched with its forward, so the
device has the whole step queued while the host processes step n; where penalties or grammar masks need step n's
tokens, it is launched after step n is processed, while the forward runs.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch

from radixlm.srt.managers.io_struct import TokenOutput
from radixlm.srt.managers.phase_board import PhaseBoard
from radixlm.srt.managers.req import Req
from radixlm.srt.managers.request_prep import check_request_limits
from radixlm.srt.managers.schedule_batch import ScheduledBatch, build_decode, build_extend, sampling_info
from radixlm.srt.managers.schedule_policy import SchedulePolicy
from radixlm.srt.managers.schedule_prefill import schedule_extend
from radixlm.srt.managers.scheduler_grammar import SchedulerGrammar
from radixlm.srt.managers.scheduler_output import SchedulerOutputMixin
from radixlm.srt.managers.step_trace import StepTrace
from radixlm.srt.mem_cache.radix_cache import ChunkCache, RadixCache
from radixlm.srt.model_executor.forward_batch import ForwardMode
from radixlm.srt.utils import freeze_startup_objects, to_device

logger = logging.getLogger(__name__)


# RADIXLM_LATE_SAMPLE=1: every batch samples after the step in flight is processed, as before sampling went out
# with the forward (an A/B switch for the serving benchmark)
_LATE_SAMPLE = os.environ.get("RADIXLM_LATE_SAMPLE") == "1"


def _no_phase(name: str | None) -> None:
    pass

INIT_NEW_TOKEN_RATIO = 0.7  # assumed fraction of max_new_tokens a request will really generate
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class BatchFailed(Exception):
    """A batch failed on the device; its requests were aborted with an error (see _fail_batch_on_oom)."""


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which served from the radix cache at first admission
    computed_prefill_tokens: int = 0  # tokens run through extend (including re-prefills after retraction)
    generated_tokens: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0  # extend steps that carried running requests' decode tokens
    retractions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    busy_seconds: float = 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler(SchedulerOutputMixin):
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
        # Overlap pays off only where the forward runs asynchronously to the host (CUDA).
        self.overlap = not args.disable_overlap_schedule and (runner.device.type == "cuda"
                                                              or args.force_overlap_schedule)
        self.mixed_chunk = args.enable_mixed_chunk
        # While streams decode, a step takes at most this many prompt tokens and the decodes ride along: on a CPU
        # a whole prompt's prefill is many decode steps long, and every stream would wait for it.
        # Off by default until measured against llama.cpp's ITL on the CPU harness (benchmarks/cpu/).
        budget = getattr(args, "decode_prefill_budget", None)
        self.decode_prefill_budget = budget if budget is not None and budget > 0 else None
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted with all prompt tokens scheduled; may still have one in flight
        self.chunked: Req | None = None
        self.inflight: ScheduledBatch | None = None  # launched, not yet processed (overlap only)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self.last_step: dict = {}
        self.step_trace = StepTrace.from_env()
        self.phase_board = PhaseBoard.from_env()
        self._outputs: list[TokenOutput] = []
        self.grammar = SchedulerGrammar(args, tokenizer, runner.vocab_size, runner.config.eos_token_ids,
                                        runner.device, self.overlap)
        freeze_startup_objects()  # the model, tokenizer and graphs, out of the collector's full passes

    # --- public interface ----------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.validate(req)
        if req.grammar_spec is not None and req.grammar is None:
            self.grammar.submit(req)  # joins `waiting` once its grammar is compiled
        else:
            self.waiting.append(req)

    def validate(self, req: Req) -> None:
        """Check a request against the model and memory limits and resolve its max_new_tokens."""
        req.max_new_tokens = check_request_limits(req.input_ids, req.sampling_params,
                                                  self.context_length, self.kv_pool.size, self.runner.vocab_size)

    def abort(self, rid: str, notify: bool = True) -> bool:
        """Stop a request wherever it is; its slots and locks are returned at once (a step still running on
        the device finishes writing them before any later step can reuse them: one stream orders all steps).
        With `notify`, the next step reports it finished with reason `abort`."""
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
        r = self.grammar.remove(rid)
        if r is not None:
            self._finish_abort(r, notify)
            return True
        return False

    def has_work(self) -> bool:
        return self._runnable() or bool(self.grammar.queue)

    def _runnable(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._outputs or self.inflight)

    def step(self) -> list[TokenOutput]:
        trace, board = self.step_trace, self.phase_board
        phase = trace.phase if trace is not None else _no_phase
        marks: list[tuple[str, float]] = []  # (phase, start): host time by phase for the step's record

        def enter(name: str) -> None:
            phase(name)
            if board is not None:
                board.enter(name)
            marks.append((name, time.perf_counter()))

        enter("schedule")
        if self.grammar.queue:
            self._poll_grammars()
        outputs, self._outputs = self._outputs, []
        batch = self._schedule()
        enter("forward")
        if batch is not None:
            try:
                self._launch_forward(batch)
            except BatchFailed:
                batch = None
        ran = batch is not None or self.inflight is not None
        if self.overlap:
            # Sampling that reads nothing from the step in flight is launched with the forward, so the device
            # has the whole step queued while the host processes the previous one; grammar masks and penalties
            # need that step's tokens, so such a batch samples after it is processed.
            early = batch is not None and self._samples_early(batch)
            launched = False
            if early:
                enter("sample")
                launched = self._launch_sample(batch)
            enter("process")
            if self.inflight is not None:
                outputs += self._process(self.inflight, None if early else batch)
                self.inflight = None
            if batch is not None and not early:
                enter("sample")
                launched = self._launch_sample(batch)
            if launched:
                self.inflight = batch
        else:
            enter("sample")
            sampled = batch is not None and self._launch_sample(batch)
            enter("process")
            if sampled:
                outputs += self._process(batch)
        outputs += self._outputs  # requests failed by a batch that ran out of memory
        self._outputs = []
        end = time.perf_counter()
        t0 = marks[0][1]
        self.stats.busy_seconds += end - t0
        if board is not None:
            board.enter(None)
        if not ran:
            phase(None)
            return outputs
        # Host time by phase (ms), in the order the phases ran. With overlap, `process` includes waiting for
        # the previous step's tokens from the device.
        info = self.last_step if batch is not None else {"mode": "drain"}
        info["phases_ms"] = {name: (stop - start) * 1e3
                             for (name, start), stop in zip(marks, [m[1] for m in marks[1:]] + [end])}
        if trace is not None:
            trace.record(t0, info, len(outputs))
        return outputs

    def _poll_grammars(self) -> None:
        ready, failed = self.grammar.poll()
        self.waiting += ready
        for r, err in failed:
            self._finish_abort(r, notify=True, message=err.message, status_code=err.status, param=err.param)
        if not ready and not failed and not self._runnable():
            self.grammar.wait_briefly()

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while requests are in flight."""
        if self.step_trace is not None:  # a quiet moment: write the trace out (servers are killed, not exited)
            self.step_trace.flush()
        if self.waiting or self.running or self.chunked:
            return False
        if self.inflight is not None:  # only finished requests' extra tokens are left in it
            self._outputs += self._process(self.inflight)
            self.inflight = None
        return self.tree_cache.flush()

    def get_stats(self) -> dict:
        s = asdict(self.stats)
        s.update(cache_hit_rate=self.stats.cache_hit_rate, num_running=len(self.running) + (self.chunked is not None),
                 num_waiting=len(self.waiting), kv_total=self.kv_pool.size, kv_free=self.kv_pool.available_size(),
                 kv_cached=self.tree_cache.total_size(), kv_evictable=self.tree_cache.evictable_size(),
                 evicted_tokens=self.tree_cache.evicted_tokens,
                 gen_throughput=self.stats.generated_tokens / self.stats.busy_seconds if self.stats.busy_seconds else 0.0,
                 new_token_ratio=self.new_token_ratio, last_step=self.last_step, overlap=self.overlap,
                 attention_backend=self.runner.attn_backend_name, grammar=asdict(self.grammar.stats()),
                 cuda_graph=self.runner.graph_runner is not None)
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

    # --- schedule ------------------------------------------------------------------------------------------
    def unlock(self, r: Req) -> None:
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

    def _schedule(self) -> ScheduledBatch | None:
        batch = schedule_extend(self)
        if batch:
            return self._schedule_extend_batch(batch)
        if not any(r.decodable(self.context_length) for r in self.running):
            return None
        self._make_decode_room()
        reqs = [r for r in self.running if r.decodable(self.context_length)]
        if not reqs:
            return None
        batch = build_decode(reqs, self._alloc(len(reqs)), self.req_pool)
        self.stats.decode_steps += 1
        self.last_step = {"mode": "decode", "batch_size": len(reqs), "tokens": len(reqs)}
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return batch

    def _schedule_extend_batch(self, batch: list[Req]) -> ScheduledBatch:
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
        riders = []
        if self.mixed_chunk or self.decode_prefill_budget is not None:
            riders = [r for r in self.running if r.decodable(self.context_length)]
            if total + len(riders) > self.kv_pool.available_size() + self.tree_cache.evictable_size():
                riders = []
        slots = self._alloc(total + len(riders))
        sb = build_extend(batch, riders, slots, self.req_pool)
        for r in batch:  # every request whose prompt is now fully scheduled decodes from the next step on
            if r.kv_len == len(r.fill_ids):
                self.running.append(r)
        self.stats.extend_steps += 1
        self.stats.mixed_steps += bool(riders)
        self.stats.computed_prefill_tokens += total
        self.last_step = {"mode": "extend", "batch_size": len(batch), "tokens": total, "decode_riders": len(riders)}
        return sb

    def _make_decode_room(self) -> None:
        """Evict cached prefixes, then retract the least advanced requests, until every runner has a slot."""
        while True:
            decoding = [r for r in self.running if r.decodable(self.context_length)]
            short = len(decoding) - self.kv_pool.available_size()
            if short <= 0:
                return
            self.tree_cache.evict(short)
            if self.kv_pool.available_size() >= len(decoding) or len(decoding) == 1:
                return
            self._retract(min(decoding, key=lambda r: (len(r.output_ids), -len(r.input_ids))))

    def _retract(self, r: Req) -> None:
        self.running.remove(r)
        self._free_kv(r)
        r.epoch += 1  # a token it still has in flight is dropped; it is sampled again after re-admission
        r.pending_ref = None
        r.retractions += 1
        self.waiting.insert(0, r)
        self.stats.retractions += 1
        # Admission was too optimistic: assume requests need all they asked for, then relax again.
        self.new_token_ratio = 1.0
        logger.debug("retracted %s after %d tokens", r.rid, len(r.output_ids))

    # --- launch --------------------------------------------------------------------------------------------
    def _launch_forward(self, batch: ScheduledBatch) -> None:
        with self._fail_batch_on_oom(batch):
            batch.logits = self.runner.run_forward(batch.spec)

    def _launch_sample(self, batch: ScheduledBatch) -> bool:
        """Sample the batch's next tokens and start their copy to the host; False if the batch failed."""
        try:
            with self._fail_batch_on_oom(batch):
                n = len(batch.sample_reqs)
                logits = batch.logits
                info = sampling_info(batch.sample_reqs, self.runner.vocab_size, logits.device) if n else None
                if n:  # grammar masks from the matchers as they are after the previous step's tokens
                    info.vocab_mask = self.grammar.batch_mask(
                        batch.sample_reqs, [batch.is_current(i) for i in batch.sample_pos], batch.mask_future)
                extra = None
                if batch.lp_next:
                    lp = torch.log_softmax(logits[n:], dim=-1)
                    nxt = to_device(torch.tensor(batch.lp_next), logits.device)
                    extra = lp.gather(1, nxt[:, None]).squeeze(1)
                batch.pending = self.runner.sample(logits[:n] if n else None, info, extra)
                batch.logits = None
        except BatchFailed:
            return False
        if self.overlap and n:
            batch.future_base = base = self.runner.store_futures(batch.pending.ids)
            for j, i in enumerate(batch.sample_pos):
                if batch.is_current(i):
                    batch.reqs[i].pending_ref = base + j
        return True

    @staticmethod
    def _samples_early(batch: ScheduledBatch) -> bool:
        if _LATE_SAMPLE:
            return False
        return not any(r.grammar is not None or r.sampling_params.has_penalties() for r in batch.sample_reqs)

    @contextlib.contextmanager
    def _fail_batch_on_oom(self, batch: ScheduledBatch):
        """A batch that runs out of device memory fails its own requests (503) and frees what they held; the
        scheduler and every other request go on."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            logger.error("out of device memory in a batch of %d requests; failing them: %s", len(batch.reqs), e)
            for i, r in enumerate(batch.reqs):
                if batch.is_current(i):  # this batch's tokens were never computed: take them back
                    r.kv_len -= batch.extend_lens[i]
            self.kv_pool.free(batch.slots)
            for i, r in enumerate(batch.reqs):
                if not batch.is_current(i):
                    continue
                if self.chunked is r:
                    self.chunked = None
                if r in self.running:
                    self.running.remove(r)
                self._finish_abort(r, notify=True, message="the server ran out of device memory running this "
                                   "request; retry it or send a shorter one", status_code=503)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise BatchFailed(f"{len(batch.reqs)} requests failed") from e

    # --- process -------------------------------------------------------------------------------------------
    def _process(self, batch: ScheduledBatch, following: ScheduledBatch | None = None) -> list[TokenOutput]:
        """Read a step's tokens back and hand them to their requests. `following`: the batch launched after it
        (overlap), whose sampling waits for this step's tokens; its grammar mask is started as soon as they are
        accepted (see SchedulerGrammar.accept_first)."""
        sampled, prompt_lps = batch.pending.wait()
        pos = 0
        for i, n in batch.lp_reqs:
            if batch.is_current(i):
                batch.reqs[i].input_token_logprobs += list(zip(prompt_lps[pos : pos + n], batch.lp_next[pos : pos + n]))
            pos += n
        sample_index = {i: j for j, i in enumerate(batch.sample_pos)}
        # No sampled rows (prompt chunks, max_new_tokens=0 only): nothing to accept, nothing sampled to read.
        accepted = (self.grammar.accept_first(batch, sampled.next_ids, sample_index, following)
                    if sampled is not None else {})
        outputs = []
        for i, r in enumerate(batch.reqs):
            if not batch.is_current(i):
                continue  # finished, aborted or retracted since it was scheduled: its result is stale
            j = sample_index.get(i)
            if j is None:
                if not batch.finals[i]:  # a chunk, more to come: share what is computed so far
                    self._publish_prefix(r)
                else:  # max_new_tokens == 0: prefill only
                    r.finished_reason = {"type": "length", "length": len(r.output_ids)}
                    outputs.append(self._output(r, []))
                    self._release(r)
                continue
            ref = None if batch.future_base is None else batch.future_base + j
            outputs.append(self._append_token(r, sampled, j, ref, accepted.get(i)))
            if r.finished:
                self._release(r)
            elif r.req_pool_idx is None:
                pass  # jumped forward: back in the waiting queue
            elif batch.mode is ForwardMode.EXTEND and batch.extend_lens[i] > 1:
                self._publish_prefix(r)  # share the prompt with others while this request decodes
        return outputs

    def _publish_prefix(self, r: Req) -> None:
        """Put the request's computed tokens into the tree so others can share them while it runs."""
        n = min(r.kv_len, len(r.fill_ids))
        if n <= len(r.prefix_slots):
            return
        kv_len, r.kv_len = r.kv_len, n
        self.tree_cache.cache_unfinished_req(r, self.req_pool.slots(r.req_pool_idx, n))
        r.kv_len = kv_len
        self.req_pool.write(r.req_pool_idx, 0, r.prefix_slots)

    # --- release -------------------------------------------------------------------------------------------
    def _free_kv(self, r: Req) -> None:
        if r.req_pool_idx is not None:
            slots = self.req_pool.slots(r.req_pool_idx, r.kv_len)
            # A slot past the known tokens holds the KV of a token still in flight: nothing can reuse it
            # before that step is done, and the tree cannot key it, so it goes straight back to the pool.
            known = min(r.kv_len, len(r.fill_ids))
            self.kv_pool.free(slots[known:])
            r.kv_len = known
            self.tree_cache.cache_finished_req(r, slots[:known])
            self.req_pool.free(r.req_pool_idx)
            r.req_pool_idx = None
        elif r.last_node is not None:
            self.unlock(r)
        r.kv_len = 0

    def _release(self, r: Req) -> None:
        if r in self.running:
            self.running.remove(r)
        self._free_kv(r)
        self.stats.finished_requests += 1

    def _finish_abort(self, r: Req, notify: bool, message: str = "request aborted",
                      status_code: int | None = None, param: str | None = None) -> None:
        self._free_kv(r)
        r.pending_ref = None
        r.grammar = None
        r.finished_reason = {"type": "abort", "message": message}
        if status_code is not None:  # a failure, not a client's abort: the HTTP layer answers with this status
            r.finished_reason["status_code"] = status_code
        if param is not None:
            r.finished_reason["param"] = param
        self.stats.aborted_requests += 1
        if notify:
            self._outputs.append(self._output(r, []))
