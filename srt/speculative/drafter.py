"""The scheduler's side of speculative decoding: which requests draft this step and what they draft.

A draft is a guess of a request's next tokens; the verify step computes the logits of the request's last token
and of every draft token in one forward (an extend over the paged KV) and samples each position as plain
decoding would, keyed by the same per-request seed and step (layers/sampler.py). A draft token is kept while it
equals the token sampled before it, so the output is exactly the non-speculative one; the first token that
differs (or the token after the last draft) comes for free. Drafts come from the radix tree first (another
request already went on from exactly this sequence: a repeated prompt, a shared agent turn), else from prompt
lookup over the request's own tokens (ngram.py).

What keeps it safe and cheap:
- Requests with repetition, frequency or presence penalties do not draft (their later positions' logits would
  depend on the draft's own counts); they decode in the same batch with no draft.
- A constrained request's draft is walked through its grammar matcher and cut at the first token the grammar
  refuses; the matcher's mask for every verified position is filled on the way, then the matcher is rolled
  back (SchedulerGrammar.draft_masks).
- A request drafts at most one token more than its last draft kept, and after a draft that held in full, one
  more (on a CPU, where every row of a step costs compute) or twice as many (elsewhere: a small batch's verify
  step costs about the same for 2 or 9 rows on a GPU, so copied text should reach k in a few steps, not k); one
  whose last draft was mostly rejected (under half of it kept) waits 1, 2, 4 ... (at most 16) steps before
  drafting again, so free-form text with spurious n-gram matches costs little.
- With several requests decoding on a CPU, a request drafts only while most of its drafts hold (`shared_floor`):
  past one row every extra row of a step costs compute there.
- A verify step computes at most `max_verify_tokens` tokens (on a GPU by default 256): a batch of B requests
  drafts at most that / B - 1 tokens a request. Up to a few hundred tokens a step's matmuls cost about what
  reading the weights costs; past that they compute, and a large batch's long drafts make a verify step cost
  several decode steps for the few tokens a request each draft gives.
- Nobody drafts at a batch size where steps with drafting measured fewer tokens per second than steps without
  (gate.py), or, when the operator sets `--speculative-max-batch-size`, above that many decoding requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.srt.speculative.ngram import NgramIndex

_MAX_SKIP = 16
DEFAULT_DRAFT_TOKENS = 8  # k where --speculative-num-draft-tokens is not given (GPU) ...
DEFAULT_DRAFT_TOKENS_CPU = 4  # ... and on a CPU
DEFAULT_MAX_VERIFY_TOKENS = 256  # a verify step's tokens where --speculative-max-verify-tokens is not given (GPU)


@dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int
    ngram_min: int
    ngram_max: int
    max_batch_size: int | None  # None: no fixed limit, the scheduler's SpecGate measures where drafting pays
    # With more than one request decoding, a request drafts only while this share of its drafts holds: where
    # every extra row of a step costs compute (a CPU past one row), a half-right draft is a loss.
    shared_floor: float = 0.0
    # After a draft that held in full the next may be twice as long (else one token longer): where a verify
    # step's rows cost little more than one row (a GPU at small batches).
    ramp_doubles: bool = False
    # The most tokens a verify step computes (None: no limit): drafts are cut to fit.
    max_verify_tokens: int | None = None

    @property
    def measured(self) -> bool:
        return self.max_batch_size is None

    @classmethod
    def from_args(cls, args, device_type: str) -> SpecConfig | None:
        if args.speculative_algorithm is None:
            return None
        cpu = device_type == "cpu"
        # On a GPU a small batch's verify step costs about the same for 5 or 9 rows and drafts grow by doubling,
        # so a longer cap pays where drafts hold; on a CPU every row costs compute.
        k = args.speculative_num_draft_tokens or (DEFAULT_DRAFT_TOKENS_CPU if cpu else DEFAULT_DRAFT_TOKENS)
        budget = args.speculative_max_verify_tokens or (None if cpu else DEFAULT_MAX_VERIFY_TOKENS)
        return cls(k, args.speculative_ngram_min, args.speculative_ngram_max,
                   args.speculative_max_batch_size, 0.7 if cpu else 0.0, ramp_doubles=not cpu,
                   max_verify_tokens=budget)  # fmt: skip


class Drafter:
    def __init__(self, cfg: SpecConfig, tree_cache, context_length: int):
        self.cfg = cfg
        self.tree_cache = tree_cache
        self.context_length = context_length

    def active(self, decoding: int) -> bool:
        return 0 < decoding and (self.cfg.max_batch_size is None or decoding <= self.cfg.max_batch_size)

    def propose(self, reqs: list, room: int) -> list[list[int]]:
        """One draft per request (possibly empty), at most `room` draft tokens in all (KV slots beyond the one
        each request needs anyway)."""
        drafts = []
        floor = self.cfg.shared_floor if len(reqs) > 1 else 0.0
        budget = self.cfg.max_verify_tokens  # each request's own row is computed anyway: drafts share the rest
        cap = max(0, budget // len(reqs) - 1) if budget is not None and reqs else None
        for r in reqs:
            d = self._draft(r, room if cap is None else min(room, cap), floor) if room > 0 else []
            room -= len(d)
            drafts.append(d)
        return drafts

    def may_draft(self, reqs: list) -> bool:
        """Whether a look for drafts could find one, judged from the tokens on the host. Under overlap a look
        costs a step its overlap (it needs the token still on the device), so the scheduler first asks this,
        for free: it looks up each request's tokens without that last one, i.e. whether the tail so far
        already matches something (copied text matches at token after token; where nothing matched one token
        earlier, a look rarely finds a draft). When nothing could draft, this stands for the look: requests
        backing off count it, as a look that found nothing would."""
        floor = self.cfg.shared_floor if len(reqs) > 1 else 0.0
        for r in reqs:
            if not r.sampling_params.has_penalties() and not self._backing_off(r, floor):
                k = self._room(r, r.produced(), 1)
                if k > 0 and self._lookup(r, k):
                    return True
        for r in reqs:
            if not r.sampling_params.has_penalties():
                self._ready(r, floor)
        return False

    def _draft(self, r, room: int, floor: float) -> list[int]:
        if r.sampling_params.has_penalties() or not self._ready(r, floor):
            return []
        k = min(self._room(r, len(r.output_ids), self.cfg.num_draft_tokens if r.spec_len is None else r.spec_len), room)
        return self._lookup(r, k) if k > 0 else []

    @staticmethod
    def _backing_off(r, floor: float) -> bool:
        return r.spec_skip > 0 or r.spec_rate < floor

    @classmethod
    def _ready(cls, r, floor: float) -> bool:
        """A look at a request that backs off: counts one of its skipped looks (False) or lets it draft."""
        if not cls._backing_off(r, floor):
            return True
        if r.spec_skip > 0:
            r.spec_skip -= 1
            return False
        # under the floor: park it, then let one draft probe whether its text has turned copyable
        r.spec_skip, r.spec_rate = _MAX_SKIP, floor
        return False

    def _room(self, r, produced: int, k: int) -> int:
        # The token sampled by the verify step is always kept, so a draft of k leaves room for k + 1 tokens.
        return min(k, r.max_new_tokens - produced - 1, self.context_length - len(r.input_ids) - produced - 1)

    def _lookup(self, r, k: int) -> list[int]:
        seq = r.fill_ids
        draft = self.tree_cache.continuation(seq, k)
        if draft:
            return draft
        if r.spec_index is None:
            r.spec_index = NgramIndex(self.cfg.ngram_min, self.cfg.ngram_max)
        r.spec_index.sync(seq, r.epoch)
        return r.spec_index.propose(k)

    def record(self, r, drafted: int, accepted: int) -> None:
        """After a verify step: the request's counters, its draft length and its back-off."""
        if not drafted:
            return
        r.spec_verify_steps += 1
        r.spec_draft_tokens += drafted
        r.spec_accepted_tokens += accepted
        r.spec_rate = 0.5 * r.spec_rate + 0.5 * accepted / drafted
        # A draft that held in full earns a longer one; otherwise the next is one longer than what held.
        k = self.cfg.num_draft_tokens
        longer = 2 * drafted if self.cfg.ramp_doubles else drafted + 1
        r.spec_len = min(k, longer) if accepted == drafted else max(1, accepted + 1)
        if 2 * accepted >= drafted:
            r.spec_misses = 0
        else:  # most of the draft was wrong: its rows cost more than the tokens they gave
            r.spec_misses += 1
            r.spec_skip = min(1 << (r.spec_misses - 1), _MAX_SKIP)
