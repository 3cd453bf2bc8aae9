"""The scheduler's per-token output: append a sampled token to its request (logprobs, grammar acceptance,
finish checks), jump-forward over text the grammar forces, and shape the TokenOutput the detokenizer gets.
A mixin of Scheduler: it reads the scheduler's pools, grammar state and queues."""
from __future__ import annotations

import time

from radixlm.srt.managers.io_struct import TokenOutput
from radixlm.srt.managers.req import Req


class SchedulerOutputMixin:
    def _append_token(self, r: Req, sampled, i: int, ref: int | None = None,
                      grammar_done: bool | None = None) -> TokenOutput:
        """`ref`: where the step put this token among the futures. A later step may already have sampled the
        request's next token (sampling launched before this step was processed): its future stays pending.
        `grammar_done`: the token was already accepted by the request's grammar (and whether that completed it)."""
        token = sampled.next_ids[i]
        r.output_ids.append(token)
        if r.pending_ref == ref:
            r.pending_ref = None
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
        new_ids, done = [token], False
        if r.grammar is not None:
            done = self.grammar.accept(r, token) if grammar_done is None else grammar_done
            if not done:
                jumped = self._jump_forward(r)
                if jumped is not None:
                    new_ids = jumped
                    done = r.grammar.is_terminated()
        r.check_finished(self.tokenizer, self.context_length)
        if done and not r.finished:  # the grammar is complete: stop without waiting for EOS
            r.finished_reason = {"type": "stop", "matched": None}
        return self._output(r, new_ids, lp, top)

    def _jump_forward(self, r: Req) -> list[int] | None:
        """Append the text the grammar forces after the token just sampled (see scheduler_grammar); returns the
        tokens this step adds in place of that one, or None."""
        room = min(r.max_new_tokens - len(r.output_ids), self.context_length - len(r.fill_ids) - 1)
        jf = self.grammar.forced_tokens(r, room)
        if jf is None:
            return None
        back, new = jf
        start = len(r.output_ids) - 1  # where this step's output begins
        # KV is only trusted before this step's token: a step already in flight may be computing that token's
        # KV, and the jump may have re-tokenized it.
        self._truncate_kv(r, len(r.input_ids) + start)
        del r.output_ids[len(r.output_ids) - back:]
        r.output_ids += new
        self.grammar.jf_tokens += len(new) - back
        self.grammar.jf_events += 1
        r.epoch += 1  # a token for it still in flight is stale now
        r.pending_ref = None
        if r.grammar.is_terminated():
            return r.output_ids[start:]  # finishes now; _process releases it
        # Back to the queue: admission finds the earlier tokens in the radix cache and one extend computes the
        # forced ones and samples the next token.
        if r in self.running:
            self.running.remove(r)
        self._free_kv(r)
        self.waiting.insert(0, r)
        return r.output_ids[start:]

    def _truncate_kv(self, r: Req, n: int) -> None:
        if r.req_pool_idx is None or r.kv_len <= n:
            return
        n = max(n, len(r.prefix_slots))
        slots = self.req_pool.slots(r.req_pool_idx, r.kv_len)
        self.kv_pool.free(slots[n:])
        r.kv_len = n

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
