"""One request's state inside the scheduler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixlm.srt.managers.io_struct import FinishReason
from radixlm.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixlm.srt.constrained.base import GrammarSpec, Matcher
    from radixlm.srt.mem_cache.radix_cache import TreeNode
    from radixlm.srt.speculative.ngram import NgramIndex


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + the request's own stop ids
    max_new_tokens: int = 0  # resolved against the context length
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # first prompt position to return logprobs for; -1: none
    stream: bool = False
    grammar_spec: GrammarSpec | None = None  # when constrained
    grammar: Matcher | None = None  # its matcher, once compiled (the request waits in the grammar queue until then)

    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping: fill_ids[:kv_len] have KV in the slots of row `req_pool_idx`; the first
    # len(prefix_slots) of them belong to the radix tree (locked through `last_node`), the rest are private.
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    extend_len: int = 0  # tokens computed in the current extend step
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    admitted: bool = False
    retractions: int = 0
    finished_reason: FinishReason | None = None
    # Overlap scheduling: the token sampled by the last launched step, which the host has not read yet, lives
    # at runner.future_map[pending_ref]. `epoch` changes on retraction, so results of steps launched before
    # are recognised as stale and dropped.
    pending_ref: int | None = None
    epoch: int = 0

    # Speculative decoding (speculative/drafter.py): the n-gram index over fill_ids, the back-off after drafts
    # that were mostly rejected (the request drafts again after `spec_skip` plain steps), its counters.
    spec_index: NgramIndex | None = None
    spec_misses: int = 0
    spec_skip: int = 0
    spec_len: int | None = None  # the request's own draft length (adapted to how much of its drafts holds)
    spec_rate: float = 1.0  # running share of its draft tokens accepted (halved weight per verify step)
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    input_token_logprobs: list = field(default_factory=list)
    input_logprobs_sent: bool = False
    detok_sent: bool = False
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids if self.output_ids else self.input_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def pending_count(self) -> int:
        return 0 if self.pending_ref is None else 1

    def produced(self) -> int:
        """Tokens generated so far, counting the one still on the device."""
        return len(self.output_ids) + self.pending_count()

    def decodable(self, context_length: int) -> bool:
        """Worth another decode step: not finished, and not certain to finish with the token still pending."""
        if self.finished:
            return False
        produced = self.produced()
        return produced < self.max_new_tokens and len(self.input_ids) + produced < context_length

    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)

    def check_finished(self, tokenizer, context_length: int) -> None:
        """Decide, after a token was appended, whether the request is done."""
        last = self.output_ids[-1]
        params = self.sampling_params
        if len(self.output_ids) >= params.min_new_tokens and last in self.stop_token_ids:
            self.finished_reason = FinishReason.stop(last)
            return
        if params.stop and len(self.output_ids) >= params.min_new_tokens:
            # Before the length limit: a stop string ending on the last allowed token is still a stop (and is
            # trimmed from the text, as OpenAI's stop semantics say). Decode only a tail long enough to hold any
            # stop string that could end at the new token.
            tail_tokens = max(len(s) for s in params.stop) + 2
            tail = tokenizer.decode(self.output_ids[-tail_tokens:], skip_special_tokens=params.skip_special_tokens)
            for s in params.stop:
                if s in tail:
                    self.finished_reason = FinishReason.stop(s)
                    return
        if len(self.output_ids) >= self.max_new_tokens or len(self.input_ids) + len(self.output_ids) >= context_length:
            self.finished_reason = FinishReason.of_length(len(self.output_ids))
