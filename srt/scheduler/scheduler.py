"""The scheduler core: a plain object that steps. `add(req)`, `abort(rid)`, `step() -> outputs`.

Each step runs either an extend batch (new requests and chunks of long prompts, admitted in policy order while
KV memory allows; with mixed chunked prefill the running requests' next tokens ride along) or a decode batch of
every running request. Requests that share a prefix reuse its KV through the radix cache; when decode runs out
of KV, the least advanced requests are retracted to the waiting queue.

A step has three phases: schedule (host bookkeeping: admission, radix matching, KV slots, batch tensors),
launch (forward, then sampling and the one device->host copy; nothing waits for the device) and process (read
the sampled tokens back, stream them, finish requests). The plain loop runs them in that order. The overlap loop
schedules and launches step n+1 before it processes step n, so the device never waits for the host: step n+1
reads step n's tokens straight from the device (futures), a request that finished at step n rides in step n+1
and its extra token is dropped. Its sampling is launched with its forward, so the device has the whole step
queued while the host processes step n; where penalties or grammar masks need step n's tokens, it is launched
after step n is processed, while the forward runs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from radixlm.srt.managers.io_struct import FinishReason, TokenOutput
from radixlm.srt.managers.request_prep import check_request_limits
from radixlm.srt.mem_cache.radix_cache import ChunkCache, RadixCache
from radixlm.srt.scheduler.batch import ScheduledBatch, build_extend, build_verify, sampling_info
from radixlm.srt.scheduler.decode import make_room, schedule_decode
from radixlm.srt.scheduler.grammar import SchedulerGrammar
from radixlm.srt.scheduler.kv import ReqKV
from radixlm.srt.scheduler.output import OutputProcessor, Processed
from radixlm.srt.scheduler.policy import SchedulePolicy
from radixlm.srt.scheduler.prefill import Admission, PrefillBudget
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stats import SchedulerStats, StepInfo
from radixlm.srt.speculative.drafter import Drafter, SpecConfig
from radixlm.srt.speculative.pacer import SpecPacer
from radixlm.srt.utils import freeze_startup_objects, to_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from radixlm.srt.model_executor.model_runner import ModelRunner
    from radixlm.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7  # assumed fraction of max_new_tokens a request will really generate
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class BatchFailed(Exception):
    """A batch failed on the device; its requests were aborted with an error (see _fail_batch_on_oom)."""


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer: PreTrainedTokenizerBase, args: ServerArgs):
        self.runner = runner
        self.tokenizer = tokenizer
        self.context_length = runner.context_length
        self.kv_pool = runner.token_to_kv_pool
        self.req_pool = runner.req_to_token_pool
        self.tree_cache = ChunkCache(self.kv_pool) if args.disable_radix_cache else RadixCache(self.kv_pool)
        self.kv = ReqKV(self.kv_pool, self.req_pool, self.tree_cache)
        policy = SchedulePolicy(args.schedule_policy, self.tree_cache, args.random_seed)
        self.admission = Admission(policy, self.kv, share_prefixes=not args.disable_radix_cache)
        self.max_running = runner.max_running_requests
        chunk = args.chunked_prefill_size
        if chunk is None:
            chunk = 8192 if runner.device.type == "cuda" else 1024
        self.chunk_size = None if chunk <= 0 else chunk
        self.max_prefill_tokens = args.max_prefill_tokens
        self.conservativeness = args.schedule_conservativeness
        # Overlap pays off only where the forward runs asynchronously to the host (CUDA).
        self.overlap = not args.disable_overlap_schedule and (
            runner.device.type == "cuda" or args.force_overlap_schedule
        )
        self.mixed_chunk = args.mixed_chunks(runner.device.type)
        # While streams decode, a step takes at most this many prompt tokens and the decodes ride along: on a CPU
        # a whole prompt's prefill is many decode steps long, and every stream would wait for it.
        budget = args.decode_prefill_budget
        self.decode_prefill_budget = budget if budget is not None and budget > 0 else None
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted with all prompt tokens scheduled; may still have one in flight
        self.chunked: Req | None = None
        self.inflight: ScheduledBatch | None = None  # launched, not yet processed (overlap only)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self.last_step: StepInfo | None = None
        self._outputs: list[TokenOutput] = []  # of requests ended outside a step (aborts, failed batches)
        self.grammar = SchedulerGrammar(
            args, tokenizer, runner.vocab_size, runner.config.eos_token_ids, runner.device, self.overlap
        )
        spec = SpecConfig.from_args(args, runner.device.type)
        self.drafter = Drafter(spec, self.tree_cache, self.context_length) if spec is not None else None
        self.spec = SpecPacer(self.drafter, self.overlap, self.stats) if self.drafter is not None else None
        self.outputs = OutputProcessor(tokenizer, self.context_length, self.grammar, self.kv, self.stats, self.drafter)
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
        req.max_new_tokens = check_request_limits(
            req.input_ids, req.sampling_params, self.context_length, self.kv_pool.size, self.runner.vocab_size
        )

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
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.begin_step(self._decoding())
        if self.grammar.queue:
            self._poll_grammars()
        outputs, self._outputs = self._outputs, []
        outputs += self._step_overlap() if self.overlap else self._step_plain()
        outputs += self._outputs  # requests failed by a batch that ran out of memory
        self._outputs = []
        elapsed = time.perf_counter() - t0
        self.stats.busy_seconds += elapsed
        if self.spec is not None:
            self.spec.end_step(elapsed)
        return outputs

    def _step_plain(self) -> list[TokenOutput]:
        batch = self._launch_forward(self._schedule(verify=True))
        if batch is None or not self._launch_sample(batch):
            return []
        return self._apply(self.outputs.process(batch))

    def _step_overlap(self) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        if self.inflight is not None and self.inflight.drafts is not None:
            # how many of a verify step's tokens were accepted is known only once it is processed: nothing is
            # scheduled after one before that
            outputs = self._process_inflight()
        if self.spec is not None and self.spec.look_in_order(self._decodable, self.inflight is not None):
            self.stats.spec_in_order_steps += 1
            # A look for drafts needs every token so far on the host (speculative/pacer.py). The step launched
            # here stays in flight until the next step: its predecessor's outputs are streamed and new requests
            # received while the device computes it (sampled already: it is processed as an early-sampled step
            # would be).
            outputs += self._process_inflight()
            batch = self._launch_forward(self._schedule(verify=True))
            if batch is not None and self._launch_sample(batch):
                self.inflight = batch
                self.last_step.sampled_early = True
            return outputs
        # Sampling that reads nothing from the step in flight is launched with the forward, so the device has
        # the whole step queued while the host processes the previous one; grammar masks and penalties need
        # that step's tokens, so such a batch samples after it is processed.
        batch = self._launch_forward(self._schedule())
        early = batch is not None and self._samples_early(batch)
        if early and not self._launch_sample(batch):
            batch = None
        outputs += self._process_inflight(None if early else batch)
        if batch is not None and not early and not self._launch_sample(batch):
            batch = None
        if batch is not None:
            self.inflight = batch
            self.last_step.sampled_early = early
        return outputs

    def _process_inflight(self, following: ScheduledBatch | None = None) -> list[TokenOutput]:
        """Process the step in flight, if any (`following`: see OutputProcessor.process); none is left after."""
        if self.inflight is None:
            return []
        batch, self.inflight = self.inflight, None
        return self._apply(self.outputs.process(batch, following))

    def _decodable(self) -> list[Req]:
        return [r for r in self.running if r.decodable(self.context_length)]

    def _decoding(self) -> int:
        return sum(r.decodable(self.context_length) for r in self.running)

    def _poll_grammars(self) -> None:
        ready, failed = self.grammar.poll()
        self.waiting += ready
        for r, err in failed:
            self._finish_abort(r, notify=True, message=err.message, status_code=err.status, param=err.param)
        if not ready and not failed and not self._runnable():
            self.grammar.wait_briefly()

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while requests are in flight."""
        if self.waiting or self.running or self.chunked:
            return False
        self._outputs += self._process_inflight()  # only finished requests' extra tokens are left in it
        return self.tree_cache.flush()

    def get_stats(self) -> dict:
        s = asdict(self.stats)
        s.update(
            cache_hit_rate=self.stats.cache_hit_rate,
            num_running=len(self.running) + (self.chunked is not None),
            num_waiting=len(self.waiting),
            waiting_tokens=sum(len(r.input_ids) for r in self.waiting),
            kv_total=self.kv_pool.size,
            kv_free=self.kv_pool.available_size(),
            kv_cached=self.tree_cache.total_size(),
            kv_evictable=self.tree_cache.evictable_size(),
            evicted_tokens=self.tree_cache.evicted_tokens,
            gen_throughput=self.stats.generated_tokens / self.stats.busy_seconds if self.stats.busy_seconds else 0.0,
            new_token_ratio=self.new_token_ratio,
            last_step=self.last_step.as_dict() if self.last_step is not None else {},
            overlap=self.overlap,
            attention_backend=self.runner.attn_backend_name,
            grammar=asdict(self.grammar.stats()),
            cuda_graph=self.runner.uses_cuda_graphs,
            tp_size=self.runner.tp.size,
            tp_ranks=self.runner.rank_reports,
            speculative=self.drafter is not None,
            spec_accept_rate=self.stats.spec_accept_rate,
            spec_accept_length=self.stats.spec_accept_length,
        )
        s["kv_used"] = s["kv_total"] - s["kv_free"] - s["kv_evictable"]
        return s

    def check_invariants(self) -> None:
        """Every slot is free, in the tree, or private to exactly one running request (tests call this)."""
        self.kv.check_invariants(self.running + ([self.chunked] if self.chunked else []))

    # --- schedule ------------------------------------------------------------------------------------------
    def _schedule(self, verify: bool = False) -> ScheduledBatch | None:
        """The next batch. `verify`: a speculative verify step may be scheduled (only where it is processed
        before the next schedule, with every earlier token on the host: the plain loop, and the overlap loop's
        in-order steps)."""
        batch = self._schedule_extend()
        if batch is not None:
            return batch
        if not any(r.decodable(self.context_length) for r in self.running):
            return None
        for r in make_room(self.running, self.kv, self.context_length):  # retracted: their KV is released
            self.waiting.insert(0, r)
            self.stats.retractions += 1
            # Admission was too optimistic: assume requests need all they asked for, then relax again.
            self.new_token_ratio = 1.0
        speculating = verify and self.spec is not None and self.spec.speculating(self._decoding())
        batch = self._schedule_verify() if speculating else None
        if batch is None:
            batch = schedule_decode(self.running, self.kv, self.req_pool, self.context_length)
        if batch is None:
            return None
        self.stats.decode_steps += 1
        if batch.drafts is None:
            self.last_step = StepInfo("decode", len(batch.reqs), len(batch.reqs))
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return batch

    def _schedule_verify(self) -> ScheduledBatch | None:
        """A decode step with drafts (see speculative/drafter.py), or None when no request drafts."""
        reqs = self._decodable()
        if self.inflight is not None or any(r.pending_ref is not None for r in reqs):
            return None  # drafts and masks need every token so far; a step in flight has some of them
        drafts, mask = self.spec.propose(reqs, self.kv.room() - len(reqs)), None
        if any(drafts):
            drafts, mask = self.grammar.draft_masks(reqs, drafts)
        if not any(drafts):
            self.spec.no_drafts()
            return None
        batch = build_verify(reqs, drafts, self.kv.alloc(len(reqs) + sum(map(len, drafts))), self.req_pool)
        batch.verify_mask = mask
        self.spec.verifying(drafts)
        self.last_step = StepInfo("verify", len(reqs), len(batch.slots))
        return batch

    def _prefill_budget(self) -> PrefillBudget:
        tokens = min(self.max_prefill_tokens, self.chunk_size or self.max_prefill_tokens)
        split = self.chunk_size is not None  # a prompt over the budget is split, not held back
        if self.decode_prefill_budget is not None and any(r.decodable(self.context_length) for r in self.running):
            tokens, split = min(tokens, self.decode_prefill_budget), True
        return PrefillBudget(
            tokens, split, self.max_running - len(self.running), self.new_token_ratio, self.conservativeness
        )

    def _schedule_extend(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        # With overlap, the extend launched last step publishes its prompts to the tree only after this schedule.
        inflight = self.inflight.reqs if self.inflight is not None and not self.inflight.mode.is_decode else []
        admitted = self.admission.admit(self.waiting, self.running, self.chunked, inflight, self._prefill_budget())
        self.chunked = admitted.chunked
        batch = admitted.batch
        if not batch:
            return None
        for r in batch:
            if r.req_pool_idx is None:
                self.kv.take_row(r)
            if not r.admitted:
                r.admitted = True
                if self.spec is not None:
                    self.spec.new_request()
                r.cached_tokens = len(r.prefix_slots)
                self.stats.prompt_tokens += len(r.input_ids)
                self.stats.cached_tokens += r.cached_tokens
        total = sum(r.extend_len for r in batch)
        riders = []
        if self.mixed_chunk or self.decode_prefill_budget is not None:
            riders = [r for r in self.running if r.decodable(self.context_length)]
            if total + len(riders) > self.kv.room():
                riders = []
        sb = build_extend(batch, riders, self.kv.alloc(total + len(riders)), self.req_pool)
        for r in batch:  # every request whose prompt is now fully scheduled decodes from the next step on
            if r.kv_len == len(r.fill_ids):
                self.running.append(r)
        self.stats.extend_steps += 1
        self.stats.mixed_steps += bool(riders)
        self.stats.computed_prefill_tokens += total
        self.last_step = StepInfo("extend", len(batch), total, len(riders))
        return sb

    # --- launch --------------------------------------------------------------------------------------------
    def _launch_forward(self, batch: ScheduledBatch | None) -> ScheduledBatch | None:
        """The batch with its forward launched, or None (no batch, or it failed)."""
        if batch is None:
            return None
        try:
            with self._fail_batch_on_oom(batch):
                batch.logits = self.runner.run_forward(batch.spec)
        except BatchFailed:
            return None
        return batch

    def _launch_sample(self, batch: ScheduledBatch) -> bool:
        """Sample the batch's next tokens and start their copy to the host; False if the batch failed."""
        try:
            with self._fail_batch_on_oom(batch):
                n = len(batch.sample_reqs)
                logits = batch.logits
                info = (
                    sampling_info(batch.sample_reqs, self.runner.vocab_size, logits.device, batch.row_offsets)
                    if n
                    else None
                )
                if batch.drafts is not None:  # every verified position's mask, filled when the drafts were cut
                    info.vocab_mask = None if batch.verify_mask is None else to_device(batch.verify_mask, logits.device)
                elif n:  # grammar masks from the matchers as they are after the previous step's tokens
                    info.vocab_mask = self.grammar.batch_mask(
                        batch.sample_reqs, [batch.is_current(i) for i in batch.sample_pos], batch.mask_future
                    )
                extra = None
                if batch.lp_next:
                    lp = torch.log_softmax(logits[n:], dim=-1)
                    nxt = to_device(torch.tensor(batch.lp_next), logits.device)
                    extra = lp.gather(1, nxt[:, None]).squeeze(1)
                batch.pending = self.runner.sample(logits[:n] if n else None, info, extra)
                batch.logits = None
        except BatchFailed:
            return False
        if self.overlap and n and batch.drafts is None:  # a verify step is processed before the next is scheduled
            batch.future_base = base = self.runner.store_futures(batch.pending.ids)
            for j, i in enumerate(batch.sample_pos):
                if batch.is_current(i):
                    batch.reqs[i].pending_ref = base + j
        return True

    @staticmethod
    def _samples_early(batch: ScheduledBatch) -> bool:
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
                self._finish_abort(
                    r,
                    notify=True,
                    message="the server ran out of device memory running this request; retry it or send a shorter one",
                    status_code=503,
                )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise BatchFailed(f"{len(batch.reqs)} requests failed") from e

    # --- queues after a step -------------------------------------------------------------------------------
    def _apply(self, done: Processed) -> list[TokenOutput]:
        for r in done.finished:
            self._release(r)
        for r in done.requeued:
            self._requeue(r)
        return done.outputs

    def _requeue(self, r: Req) -> None:
        """Back to the front of the waiting queue (retracted, or re-extended after a jump-forward)."""
        if r in self.running:
            self.running.remove(r)
        self.kv.release(r)
        self.waiting.insert(0, r)

    def _release(self, r: Req) -> None:
        if r in self.running:
            self.running.remove(r)
        self.kv.release(r)
        self.stats.finished_requests += 1

    def _finish_abort(
        self,
        r: Req,
        notify: bool,
        message: str = "request aborted",
        status_code: int | None = None,
        param: str | None = None,
    ) -> None:
        self.kv.release(r)
        r.pending_ref = None
        r.grammar = None
        r.finished_reason = FinishReason.abort(message, status_code, param)
        self.stats.aborted_requests += 1
        if notify:
            self._outputs.append(self.outputs.output(r, []))
