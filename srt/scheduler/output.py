"""A processed step: its sampled tokens appended to their requests (logprobs, grammar acceptance, finish checks,
jump-forward over text the grammar forces) and the TokenOutput each request sends to the detokenizer.

Queue changes are the scheduler's: `process` says which requests finished and which go back to the waiting
queue (a jump-forward re-extends them), and leaves the queues alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixlm.srt.managers.io_struct import FinishReason, TokenOutput
from radixlm.srt.model_executor.forward_batch import ForwardMode
from radixlm.srt.sampling.sampling_params import SamplingParams
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.grammar import SchedulerGrammar
from radixlm.srt.scheduler.kv import ReqKV
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stats import SchedulerStats
from radixlm.srt.speculative.drafter import Drafter


@dataclass
class Processed:
    outputs: list[TokenOutput] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)  # to release
    requeued: list[Req] = field(default_factory=list)  # to release and put back at the front of the waiting queue


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        context_length: int,
        grammar: SchedulerGrammar,
        kv: ReqKV,
        stats: SchedulerStats,
        drafter: Drafter | None = None,
    ):
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.context_length = context_length
        self.grammar = grammar
        self.kv = kv
        self.stats = stats

    def process(self, batch: ScheduledBatch, following: ScheduledBatch | None = None) -> Processed:
        """Read a step's tokens back and hand them to their requests. `following`: the batch launched after it
        (overlap), whose sampling waits for this step's tokens; its grammar mask is started as soon as they are
        accepted (see SchedulerGrammar.accept_first)."""
        if batch.drafts is not None:
            return self._process_verify(batch)
        sampled, prompt_lps = batch.pending.wait()
        pos = 0
        for i, n in batch.lp_reqs:
            if batch.is_current(i):
                batch.reqs[i].input_token_logprobs += list(zip(prompt_lps[pos : pos + n], batch.lp_next[pos : pos + n]))
            pos += n
        sample_index = {i: j for j, i in enumerate(batch.sample_pos)}
        # No sampled rows (prompt chunks, max_new_tokens=0 only): nothing to accept, nothing sampled to read.
        accepted = (
            self.grammar.accept_first(batch, sampled.next_ids, sample_index, following) if sampled is not None else {}
        )
        out = Processed()
        for i, r in enumerate(batch.reqs):
            if not batch.is_current(i):
                continue  # finished, aborted or retracted since it was scheduled: its result is stale
            j = sample_index.get(i)
            if j is None:
                if not batch.finals[i]:  # a chunk, more to come: share what is computed so far
                    self.kv.publish_prefix(r)
                else:  # max_new_tokens == 0: prefill only
                    r.finished_reason = FinishReason.of_length(len(r.output_ids))
                    out.outputs.append(self.output(r, []))
                    out.finished.append(r)
                continue
            ref = None if batch.future_base is None else batch.future_base + j
            new_ids, jumped = self._append_token(r, sampled, j, ref, accepted.get(i))
            out.outputs.append(self.output(r, new_ids, sampled, j))
            if r.finished:
                out.finished.append(r)
            elif jumped:
                # Back to the queue: admission finds the earlier tokens in the radix cache and one extend
                # computes the forced ones and samples the next token.
                out.requeued.append(r)
            elif batch.mode is ForwardMode.EXTEND and batch.extend_lens[i] > 1:
                self.kv.publish_prefix(r)  # share the prompt with others while this request decodes
        return out

    def _process_verify(self, batch: ScheduledBatch) -> Processed:
        """A speculative verify step: each request's sampled positions are taken in order while the token sampled
        at a position equals the draft token the next position was computed from; the first that differs, or
        the one after the last draft, ends the request's step. Each token is appended exactly as a plain decode
        step would (grammar, stop checks, logprobs), so the answer is the non-speculative one; the KV of the
        rejected draft tokens is freed at once."""
        sampled, _ = batch.pending.wait()
        out = Processed()
        row = 0
        for i, r in enumerate(batch.reqs):
            draft = batch.drafts[i]
            first, row = row, row + 1 + len(draft)
            if not batch.is_current(i):
                continue
            start_kv = r.kv_len - 1 - len(draft)  # the position of the request's last token before this step
            new_ids, accepted, jumped = [], 0, False  # tokens taken: the accepted drafts and one more
            for j in range(1 + len(draft)):
                last = j == len(draft) or sampled.next_ids[first + j] != draft[j]
                ids, jumped = self._append_token(r, sampled, first + j, None, None, jump=last)
                new_ids += ids
                if r.finished or last:
                    break
                accepted += 1
            self.drafter.record(r, len(draft), accepted)
            self.stats.spec_accepted_tokens += accepted
            # The last token and the accepted drafts have KV now; the token taken last is computed next step.
            self.kv.truncate(r, start_kv + 1 + accepted)
            out.outputs.append(self.output(r, new_ids, sampled, first + accepted, accepted + 1))
            if r.finished:
                out.finished.append(r)
            elif jumped:
                out.requeued.append(r)
        return out

    def _append_token(
        self, r: Req, sampled, i: int, ref: int | None, grammar_done: bool | None, jump: bool = True
    ) -> tuple[list[int], bool]:
        """Append the token; returns the ids this step adds (more than one after a jump-forward) and whether it
        jumped forward. `ref`: where
        the step put this token among the futures; a later step may already have sampled the request's next
        token (sampling launched before this step was processed): its future stays pending. `grammar_done`:
        the token was already accepted by the request's grammar (and whether that completed it). `jump`: a
        jump-forward may follow (a verify step allows it only after its last token)."""
        token = sampled.next_ids[i]
        r.output_ids.append(token)
        if r.pending_ref == ref:
            r.pending_ref = None
        self.stats.generated_tokens += 1
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        if r.return_logprob:
            r.output_token_logprobs.append((sampled.logprobs[i], token))
            if r.top_logprobs_num:
                k = r.top_logprobs_num
                r.output_top_logprobs.append(list(zip(sampled.top_logprobs[i][:k], sampled.top_ids[i][:k])))
        new_ids, done, jumped = [token], False, False
        if r.grammar is not None:
            done = self.grammar.accept(r, token) if grammar_done is None else grammar_done
            if not done and jump:
                forced = self._jump_forward(r)
                if forced is not None:
                    new_ids, jumped = forced, True
                    done = r.grammar.is_terminated()
        r.check_finished(self.tokenizer, self.context_length)
        if done and not r.finished:  # the grammar is complete: stop without waiting for EOS
            r.finished_reason = FinishReason.stop()
        return new_ids, jumped

    def _jump_forward(self, r: Req) -> list[int] | None:
        """Append the text the grammar forces after the token just sampled (see grammar.py); returns the tokens
        this step adds in place of that one, or None."""
        room = min(r.max_new_tokens - len(r.output_ids), self.context_length - len(r.fill_ids) - 1)
        jf = self.grammar.forced_tokens(r, room)
        if jf is None:
            return None
        back, new = jf
        start = len(r.output_ids) - 1  # where this step's output begins
        # KV is only trusted before this step's token: a step already in flight may be computing that token's
        # KV, and the jump may have re-tokenized it.
        self.kv.truncate(r, len(r.input_ids) + start)
        del r.output_ids[len(r.output_ids) - back :]
        r.output_ids += new
        self.grammar.jf_tokens += len(new) - back
        self.grammar.jf_events += 1
        r.epoch += 1  # a token for it still in flight is stale now
        r.pending_ref = None
        return r.output_ids[start:]

    def output(self, r: Req, new_ids: list[int], sampled=None, i: int = 0, sampled_tokens: int = 1) -> TokenOutput:
        """The request's update for this step (`sampled`: the step's samples; the logprobs of the request's last
        `sampled_tokens` tokens go with it, more than one after a speculative verify)."""
        lp = top = None
        if sampled is not None and r.return_logprob:
            lp = r.output_token_logprobs[-sampled_tokens:]
            top = r.output_top_logprobs[-sampled_tokens:] if r.top_logprobs_num else None
        o = TokenOutput(
            rid=r.rid,
            new_ids=new_ids,
            prompt_tokens=len(r.input_ids),
            completion_tokens=len(r.output_ids),
            cached_tokens=r.cached_tokens,
            finished_reason=r.finished_reason,
            output_logprobs=lp,
            output_top_logprobs=top,
        )
        if r.spec_verify_steps:
            o.spec = (r.spec_verify_steps, r.spec_draft_tokens, r.spec_accepted_tokens)
        if not r.detok_sent:
            o.detok = _detok_options(r.sampling_params)
            r.detok_sent = True
        if r.input_token_logprobs and not r.input_logprobs_sent:
            o.input_logprobs = r.input_token_logprobs
            r.input_logprobs_sent = True
        return o


def _detok_options(p: SamplingParams) -> dict:
    return {
        "skip_special_tokens": p.skip_special_tokens,
        "stop": p.stop,
        "no_stop_trim": p.no_stop_trim,
        "spaces_between_special_tokens": p.spaces_between_special_tokens,
    }
