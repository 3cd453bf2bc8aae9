"""The scheduler's side of constrained decoding: the grammar queue (requests wait there, off the batch, until a
worker thread has compiled their grammar), the token bitmask of each sampled batch (filled on the host while the
forward runs, then one copy to the device), token acceptance, and jump-forward.

Jump-forward: when a request's grammar allows exactly one continuation (a JSON key, punctuation, a fixed
field), that text is appended at once instead of being sampled token by token. The last sampled token and the
forced text are tokenized together, so the boundary is what the tokenizer would produce; the request then goes
back to the waiting queue and one extend computes all of it, its earlier tokens found again in the radix cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field

import torch

from radixlm.srt.constrained.bitmask import allocate
from radixlm.srt.constrained.manager import GrammarManager, GrammarTicket, create_backend
from radixlm.srt.errors import GrammarError, GrammarTimeout
from radixlm.srt.utils import to_device

logger = logging.getLogger(__name__)

_JF_MIN_TOKENS = 2  # a forced continuation shorter than this is cheaper to sample than to re-extend
_IDLE_WAIT_S = 0.005


class _LazyBackend:
    """Builds the real backend on first use, in a worker thread: the vocabulary index takes a second or more,
    which a server that never sees a grammar should not pay at start-up."""

    def __init__(self, name: str, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.name = name
        self._args = (tokenizer, vocab_size, stop_ids)
        self._backend = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._backend is None:
                self._backend = create_backend(self.name, *self._args)
            return self._backend

    def compile(self, spec):
        return self.get().compile(spec)

    def promotion(self, spec):
        return self.get().promotion(spec)


@dataclass
class GrammarStatsView:
    waiting: int
    compiles: int
    cache_hits: int
    failures: int
    timeouts: int
    jump_forward_tokens: int
    jump_forward_events: int
    compile_seconds_sum: float = 0.0
    compile_buckets: list[int] = field(default_factory=list)  # cumulative counts, le = manager.COMPILE_BUCKETS
    promotions: int = 0


class SchedulerGrammar:
    def __init__(
        self, args, tokenizer, vocab_size: int, stop_ids: list[int], device: torch.device, overlap: bool = False
    ):
        self.backend_name = args.grammar_backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        # Under overlap scheduling a jump sends its request back through an extend step while the others
        # decode, so steps stop being plain decode batches (as SGLang did, jump-forward is off there by default).
        self.jump_forward = args.jump_forward == "on" or (args.jump_forward == "auto" and not overlap)
        self.manager = None
        if args.grammar_backend != "none":
            lazy = _LazyBackend(args.grammar_backend, tokenizer, vocab_size, stop_ids)
            self.manager = GrammarManager(
                lazy, timeout=args.grammar_compile_timeout, promote=not args.disable_grammar_promotion
            )
        self.queue: list[tuple[object, GrammarTicket]] = []  # (Req, ticket)
        self._mask = None
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None
        self.jf_tokens = 0
        self.jf_events = 0

    # --- the grammar queue ---------------------------------------------------------------------------------
    def submit(self, req) -> None:
        if self.manager is None:
            raise GrammarError(
                "structured output is disabled on this server (--grammar-backend none)", param=req.grammar_spec.kind
            )
        self.queue.append((req, self.manager.request(req.grammar_spec)))

    def poll(self) -> tuple[list, list[tuple[object, GrammarError]]]:
        """Requests whose grammar is ready (matcher attached), and requests whose compile failed."""
        ready, failed, keep = [], [], []
        for req, ticket in self.queue:
            result = ticket.poll()
            if result is None:
                keep.append((req, ticket))
            elif isinstance(result, GrammarError):
                if isinstance(result, GrammarTimeout):
                    self.manager.stats.timeouts += 1
                    self.manager.forget(req.grammar_spec)  # a later request may try again
                failed.append((req, result))
            else:
                try:
                    req.grammar = result.matcher()
                    ready.append(req)
                except Exception as e:  # noqa: BLE001 - a matcher that cannot start fails its request only
                    failed.append(
                        (
                            req,
                            GrammarError(
                                f"the {req.grammar_spec.describe()} cannot be used: {e}", param=req.grammar_spec.kind
                            ),
                        )
                    )
        self.queue = keep
        return ready, failed

    def remove(self, rid: str):
        for i, (req, _) in enumerate(self.queue):
            if req.rid == rid:
                del self.queue[i]
                return req
        return None

    def wait_briefly(self) -> None:
        """Nothing else to do: block a few ms on the compiles instead of spinning."""
        if self.queue:
            concurrent.futures.wait(
                [t.future for _, t in self.queue], timeout=_IDLE_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED
            )

    # --- masks ---------------------------------------------------------------------------------------------
    def batch_mask(
        self, reqs: list, current: list[bool], started: concurrent.futures.Future | None = None
    ) -> torch.Tensor | None:
        """The [B, ceil(V / 32)] allowed-token bitmask on the device for a batch's sampled rows, or None when no
        row is constrained. Rows of unconstrained or stale requests allow everything. `started`: the same mask
        already being filled (start_mask)."""
        mask = started.result() if started is not None else self._fill(reqs, current)
        return None if mask is None else to_device(mask, self.device)

    def start_mask(self, reqs: list, current: list[bool]) -> concurrent.futures.Future:
        """Fill a batch's mask on the mask thread (the backends' fills run without the GIL), while the scheduler
        goes on with the rest of the step; batch_mask(started=...) takes the result. Only for matchers nothing
        else moves meanwhile: not with jump-forward, which rewinds and advances them while a step is processed."""
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._filler.submit(self._fill, reqs, current)

    def _fill(self, reqs: list, current: list[bool]) -> torch.Tensor | None:
        rows = [i for i, (r, cur) in enumerate(zip(reqs, current)) if cur and r.grammar is not None]
        if not rows:
            return None
        n = len(reqs)
        if self._mask is None or self._mask.shape[0] < n:
            self._mask = allocate(max(n, 64), self.vocab_size, pin=self.device.type == "cuda")
        mask = self._mask[:n]
        mask.fill_(-1)
        by_kind: dict[type, list] = {}
        for i in rows:  # one batched fill per backend's matcher class
            by_kind.setdefault(type(reqs[i].grammar), []).append((reqs[i].grammar, i))
        for kind, pairs in by_kind.items():
            kind.fill_masks(pairs, mask)
        return mask

    def draft_masks(self, reqs: list, drafts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Speculative verify: each constrained request's draft cut at the first token its grammar refuses, and
        the host bitmask of every verified position (request i owns 1 + len(draft i) rows, in order): row j is
        the grammar's state after the request's first j draft tokens. The matchers end where they started.
        None for the mask when no request is constrained."""
        if not any(r.grammar is not None for r in reqs):
            return drafts, None
        mask = allocate(sum(1 + len(d) for d in drafts), self.vocab_size, pin=False)  # rows for the uncut drafts
        cut, row = [], 0
        for r, d in zip(reqs, drafts):
            m = r.grammar
            if m is not None:
                m.fill_mask(mask, row)
                keep = 0
                while keep < len(d) and m.accept(d[keep]):
                    if m.is_terminated():  # the request ends on this token: sampling it is the last position
                        m.rollback(1)
                        break
                    keep += 1
                    m.fill_mask(mask, row + keep)
                if keep:
                    m.rollback(keep)
                d = d[:keep]
            cut.append(d)
            row += 1 + len(d)
        mask = mask[:row]
        return cut, mask

    def accept_first(self, batch, next_ids: list[int], sample_index: dict[int, int], following) -> dict[int, bool]:
        """Under overlap, the batch launched after `batch` samples once `batch`'s tokens are accepted by their
        grammars, so its mask lies on the host's critical path (from those tokens reaching the host to the next
        forward's launch). Here the constrained requests of `batch` accept their tokens first and `following`'s
        mask starts filling on the mask thread, while the rest of `batch` is processed; its sampling takes the
        mask when it is launched. Returns {index in batch: the grammar is complete} for the tokens accepted here
        (none when `following` has no constrained row, or with jump-forward: see start_mask)."""
        if following is None or self.jump_forward or not any(r.grammar is not None for r in following.sample_reqs):
            return {}
        done = {}
        for i, r in enumerate(batch.reqs):
            j = sample_index.get(i)
            if j is not None and r.grammar is not None and batch.is_current(i):
                done[i] = self.accept(r, next_ids[j])
        # Rows of requests this step finishes are filled too; their tokens are dropped with the stale rows.
        following.mask_future = self.start_mask(
            following.sample_reqs, [following.is_current(i) for i in following.sample_pos]
        )
        return done

    def accept(self, req, token: int) -> bool:
        """Feed a sampled token to the request's matcher; True when the grammar is complete."""
        m = req.grammar
        if not m.accept(token):  # only possible when every allowed token was masked by something else
            logger.warning("request %s: token %d is not allowed by its grammar", req.rid, token)
            return True
        return m.is_terminated()

    # --- jump-forward --------------------------------------------------------------------------------------
    def forced_tokens(self, req, room: int) -> tuple[int, list[int]] | None:
        """(tokens to take back, tokens to append) when the grammar forces text after the request's last token;
        None when there is nothing worth jumping over. At most `room` tokens are appended."""
        if not self.jump_forward or req.grammar is None or req.return_logprob or not req.output_ids:
            return None
        text = req.grammar.forced_continuation()
        if not text:
            return None
        last = req.output_ids[-1]
        merged = self.tokenizer.encode(self.tokenizer.decode([last]) + text, add_special_tokens=False)
        if merged and merged[0] == last:
            back, new = 0, merged[1:]
        else:
            back, new = 1, merged
        if len(new) - back < _JF_MIN_TOKENS or len(new) - back > room:
            return None
        m = req.grammar
        m.rollback(back)
        for i, t in enumerate(new):  # the retokenized text must still be what the grammar allows
            if not m.accept(t):
                m.rollback(i)
                if back:
                    m.accept(last)
                return None
        return back, new

    def stats(self) -> GrammarStatsView:
        s = self.manager.stats if self.manager else None
        return GrammarStatsView(
            len(self.queue),
            s.compiles if s else 0,
            s.cache_hits if s else 0,
            s.failures if s else 0,
            s.timeouts if s else 0,
            self.jf_tokens,
            self.jf_events,
            s.compile_seconds_sum if s else 0.0,
            list(s.compile_buckets) if s else [],
            s.promotions if s else 0,
        )

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
        if self._filler is not None:
            self._filler.shutdown(wait=False)
