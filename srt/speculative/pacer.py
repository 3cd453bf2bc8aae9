"""The scheduler's speculative decoding between steps: whether a step may draft, when the overlap loop looks for
drafts at all, and what the gate learns from each step.

Drafts are looked up on the host from every token so far, so under the overlap scheduler a step that looks for
drafts runs in order (the token in flight must reach the host first), as SGLang does with its n-gram drafts. A
look that finds nothing therefore costs a step its overlap; so after one the next 1, 2, 4 ... (at most 16) steps
run overlapped before the next look (free text keeps nearly all of the overlap, and a request that starts
copying drafts within a few steps), and before a look the drafter is asked, for free, whether the host's tokens
could match anything (Drafter.may_draft). A new request ends the pause: it may draft at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixlm.srt.speculative.drafter import Drafter
from radixlm.srt.speculative.gate import SpecGate

if TYPE_CHECKING:
    from radixlm.srt.scheduler.stats import SchedulerStats

MAX_LOOK_PAUSE = 16


class SpecPacer:
    def __init__(self, drafter: Drafter, overlap: bool, stats: SchedulerStats):
        self.drafter = drafter
        # measured: nobody drafts at batch sizes where steps with drafting delivered fewer tokens/s than without
        self.gate = SpecGate() if drafter.cfg.measured else None
        self.overlap = overlap
        self.stats = stats
        self.pause = 0  # overlap steps left before drafts are looked for again (no_drafts)
        self.idle = 0  # the last pause's length
        self._view: tuple[int, bool, int, int] | None = None  # the gate's view of the step under way

    # --- a step's bookkeeping for the gate ----------------------------------------------------------------------
    def begin_step(self, decoding: int) -> None:
        """Before a step of `decoding` decodable requests: its batch size and whether drafting may run."""
        if self.gate is not None:
            st = self.stats
            self._view = (decoding, self.gate.allows(decoding), st.extend_steps, st.generated_tokens)

    def end_step(self, seconds: float) -> None:
        if self.gate is None or self._view is None:
            return
        n, is_open, extends, tokens = self._view
        st = self.stats
        counted = None if st.extend_steps != extends or n == 0 else is_open  # extends count in neither mode
        self.gate.observe(counted, n, st.generated_tokens - tokens, seconds)
        st.spec_gate_closures = self.gate.closures
        self._view = None

    # --- whether and what to draft ------------------------------------------------------------------------------
    def speculating(self, decoding: int) -> bool:
        return self.drafter.active(decoding) and (self.gate is None or self.gate.allows(decoding))

    def look_in_order(self, decodable: Callable[[], list], inflight: bool) -> bool:
        """Overlap loop: whether this step runs in order to look for drafts for the decodable requests (listed
        only when a look is due: most overlapped steps are inside a pause; `inflight`: a step is on the device)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        reqs = decodable()
        if not self.speculating(len(reqs)):
            return False
        if not inflight or self.drafter.may_draft(reqs):  # with nothing in flight a look costs nothing
            return True
        self.stats.spec_looks_skipped += 1
        self.no_drafts()
        return False

    def propose(self, reqs: list, room: int) -> list[list[int]]:
        """The drafts for a verify step of `reqs` within `room` KV slots (Drafter.propose)."""
        return self.drafter.propose(reqs, room)

    def verifying(self, drafts: list[list[int]]) -> None:
        """A verify step with these drafts (after the grammar cut them) is scheduled."""
        self.idle = 0
        st = self.stats
        st.spec_verify_steps += 1
        st.spec_drafting_requests += sum(1 for d in drafts if d)
        st.spec_draft_tokens += sum(map(len, drafts))

    def no_drafts(self) -> None:
        """A step that could have verified drafts found none (or none could): pause the looks (module doc)."""
        if self.overlap:
            self.idle = min(2 * self.idle or 1, MAX_LOOK_PAUSE)  # 1, 2, 4 ... 16
            self.pause = self.idle

    def new_request(self) -> None:
        """A request was admitted: it may draft, so look at the next decode step (the pause's length stays, so
        a look that finds nothing waits as long as the last one did)."""
        self.pause = 0
