"""Whether drafting pays at the current batch size, from what the scheduler measured on this machine.

Drafting costs more than its verify steps: each draft token is a row of the forward, a request whose drafts
miss decodes in between, and under the overlap scheduler a step that looks for drafts runs in order. How much
depends on the device, the model and the batch (a small model's verify step measured 2.6-4x its decode step
on a GPU; on a CPU every extra row costs compute), so the scheduler does not guess a batch size. For each
batch-size bucket (1, 2-3, 4-7, 8-15, ...) it compares the tokens per second of whole stretches of steps with
drafting allowed (open: verify steps, the decode steps between them, the in-order looks) against stretches
with drafting off (closed); every JUDGE_STEPS open steps it judges the last stretch, and a bucket whose open
stretch delivered less closes. A closed bucket opens again for a probe after a pause that doubles each time the
probe loses (32 steps up to 1,024), so a workload that turns copy-heavy is noticed and free text pays little
for the probes; a bucket where drafting keeps winning closes for a short stretch now and then to measure
decoding afresh, as contexts grow and steps slow down.

Only steady steps count: one whose bucket and mode were those of the step before it (the first step after a
switch drains or refills the overlap pipeline, which is neither mode's own cost); extends count in neither."""

from __future__ import annotations

from dataclasses import dataclass

JUDGE_STEPS = 16  # open steps per judgement
MEASURE_STEPS = 16  # closed steps taken to measure decoding when there is no fresh figure
FIRST_PAUSE = 32  # steps a losing bucket stays closed before its first probe
MAX_PAUSE = 1024
REFRESH_EVERY = 512  # steps between fresh measurements of decoding while drafting wins


@dataclass
class Stretch:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SpecGate:
    def __init__(self):
        self.step = 0
        self.opened: dict[int, Stretch] = {}  # the open stretch being measured
        self.closed: dict[int, Stretch] = {}  # the current (or last) closed stretch
        self.closed_until: dict[int, int] = {}
        self.pause: dict[int, int] = {}
        self.refresh_at: dict[int, int] = {}
        self.closures = 0  # times a bucket closed because drafting lost (reported as a stat)
        self._last: tuple[bool, int] | None = None

    @staticmethod
    def bucket(n: int) -> int:
        return max(1, n).bit_length()

    def allows(self, n: int) -> bool:
        return self.step >= self.closed_until.get(self.bucket(n), 0)

    def plain_rate(self, b: int) -> float | None:
        s = self.closed.get(b)
        return s.rate if s is not None and s.steps >= MEASURE_STEPS // 2 else None

    def observe(self, is_open: bool | None, n: int, tokens: int, seconds: float) -> None:
        """One scheduler step of n decoding requests: `is_open` whether drafting was allowed at its batch size
        (None: an extend, counted nowhere), `tokens` the tokens it gave, `seconds` its wall time."""
        self.step += 1
        key = None if is_open is None else (is_open, self.bucket(n))
        steady, self._last = key is not None and key == self._last, key
        if not steady or seconds <= 0:
            return
        b = self.bucket(n)
        if not is_open:
            self.closed.setdefault(b, Stretch()).add(tokens, seconds)
            return
        s = self.opened.setdefault(b, Stretch())
        s.add(tokens, seconds)
        if s.steps < JUDGE_STEPS:
            return
        plain = self.plain_rate(b)
        if plain is None:  # nothing to compare with: decode plainly for a stretch
            self._close(b, MEASURE_STEPS, measure=True)
        elif s.rate < plain:
            self.pause[b] = min(2 * self.pause.get(b, FIRST_PAUSE // 2), MAX_PAUSE)
            self._close(b, self.pause[b])
            self.closures += 1
        else:
            self.pause.pop(b, None)
            self.opened[b] = Stretch()  # judge the next stretch on its own
            if self.step >= self.refresh_at.setdefault(b, self.step + REFRESH_EVERY):
                self._close(b, MEASURE_STEPS, measure=True)

    def _close(self, b: int, steps: int, measure: bool = False) -> None:
        self.closed_until[b] = self.step + steps
        self.opened[b] = Stretch()
        self.closed[b] = Stretch()  # decoding is measured afresh in every closed stretch
        if measure:
            self.refresh_at[b] = self.step + steps + REFRESH_EVERY
