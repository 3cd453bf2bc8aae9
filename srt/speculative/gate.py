"""Whether drafting pays at the current batch size, from what the scheduler measured on this machine.

Drafting costs more than its verify steps: each draft token is a row of the forward, a request whose drafts
miss decodes in between, and under the overlap scheduler a step that looks for drafts runs in order. How much
depends on the device, the model and the batch (a small model's verify step measured 2.6-4x its decode step
on a GPU; on a CPU every extra row costs compute), so the scheduler does not guess a batch size. For each
batch-size bucket (1, 2-3, 4-7, 8-15, ...) it compares the tokens per second of whole stretches of steps with
drafting allowed (open: verify steps, the decode steps between them, the in-order looks) against stretches
with drafting off (closed); every JUDGE_STEPS open steps it judges the last stretch, and a bucket whose open
stretch delivered less closes. A closed bucket opens again for a probe after a pause that doubles each time the
probe loses (up to 1,024 steps; the first pause is set by what drafting lost, below), so a workload that
turns copy-heavy is noticed and free text pays little for the probes; a bucket where drafting keeps winning
closes for a short stretch now and then to measure decoding afresh, as contexts grow and steps slow down.

A bucket starts closed, measuring decoding first (free: those steps run at plain speed). A bucket judged for
the first time, or after a win, is judged on JUDGE_STEPS open steps (shorter stretches misjudge a winning
bucket on a few unlucky drafts); one that lost before probes with PROBE_STEPS, because a losing probe is the
gate's only cost and is paid again after every pause (a verify step can cost several decode steps: 4-5x for a
small model on a GPU at 32 requests), and so does a stretch losing by half or more. The first pause is as long
as makes a probe that loses as much cost PROBE_SHARE of the decoding between probes, and a loss closes the
larger buckets too unless they have won on their own: drafting pays less as the batch grows, so a loss at 8
requests is news about 32 (which, when its pause ends, decodes plainly for a figure of its own before its first
probe).

Only steady steps count: one whose bucket and mode were those of the step before it (the first step after a
switch drains or refills the overlap pipeline, which is neither mode's own cost); extends count in neither.
A stretch's rate leaves out steps that took several times its median step (a host pause, which would decide
a judgement of ~16 one-millisecond steps by itself), and one won stretch after losses halves the pause the
next loss doubles rather than forgetting it (a win may be noise)."""

from __future__ import annotations

from dataclasses import dataclass, field

JUDGE_STEPS = 16  # open steps per judgement
PROBE_STEPS = 4  # ... for a bucket that lost before: its probes are paid again after every pause
EARLY_LOSS = 0.5  # an open stretch delivering less than this share of decoding's rate is judged after PROBE_STEPS
MEASURE_STEPS = 8  # closed steps taken to measure decoding when there is no fresh figure
FIRST_PAUSE = 32  # fewest steps a losing bucket stays closed before its first probe
MAX_PAUSE = 1024
# A first loss pauses long enough that a probe losing as much costs at most this share of the decoding time the
# pause spans (a verify step at 64 requests on an 8B model costs ~3 decode steps more than its tokens are worth:
# a probe there is ~1,000 steps' 1.5%, where a fixed pause of a few hundred steps made the probes cost 5-8%)
PROBE_SHARE = 0.015
REFRESH_EVERY = 512  # steps between fresh measurements of decoding while drafting wins
OUTLIER = 4.0  # a step taking over this many times a stretch's median step is a host pause, not the mode's cost
_MAX_BUCKET = 20  # bucket of a million decoding requests


@dataclass
class Stretch:
    times: list[float] = field(default_factory=list)  # each step's wall time
    tokens: list[int] = field(default_factory=list)  # and the tokens it gave
    # (steps, rate, seconds, tokens, kept steps) last computed: a closed stretch is read every open step
    _kept: tuple[int, float, float, int, int] = (0, 0.0, 0.0, 0, 0)

    def add(self, tokens: int, seconds: float) -> None:
        self.times.append(seconds)
        self.tokens.append(tokens)

    @property
    def steps(self) -> int:
        return len(self.times)

    @property
    def rate(self) -> float:
        """Tokens per second over the stretch's steps, leaving out steps that took over OUTLIER times the median
        step: a host pause (a collection, a preempted core) of a few milliseconds in a stretch of ~1 ms steps
        would otherwise decide a judgement by itself. A verify step costs a few decode steps, well under it."""
        return self._trimmed()[1]

    @property
    def step_seconds(self) -> float:
        """The mean step of the steps `rate` counts."""
        _, _, seconds, _, steps = self._trimmed()
        return seconds / steps if steps else 0.0

    def lost_per_step(self, plain: float) -> float:
        """Seconds a counted step took beyond what decoding at `plain` tokens/s needs for its tokens."""
        _, _, seconds, tokens, steps = self._trimmed()
        return max(0.0, seconds - tokens / plain) / steps if steps and plain > 0 else 0.0

    def _trimmed(self) -> tuple[int, float, float, int, int]:
        if self._kept[0] == len(self.times):
            return self._kept
        cap = OUTLIER * sorted(self.times)[len(self.times) // 2] if len(self.times) >= 3 else float("inf")
        kept = [(t, n) for t, n in zip(self.times, self.tokens) if t <= cap]
        seconds, tokens = sum(t for t, _ in kept), sum(n for _, n in kept)
        self._kept = (len(self.times), tokens / seconds if seconds > 0 else 0.0, seconds, tokens, len(kept))
        return self._kept


class SpecGate:
    def __init__(self):
        self.step = 0
        self.opened: dict[int, Stretch] = {}  # the open stretch being measured
        self.closed: dict[int, Stretch] = {}  # the current (or last) closed stretch
        self.closed_until: dict[int, int] = {}
        self.pause: dict[int, int] = {}  # buckets judged on short stretches (they lost last time): their pause
        self.lost: dict[int, int] = {}  # the pause a bucket's next loss doubles: halved by a win, not forgotten
        self.refresh_at: dict[int, int] = {}
        self.closures = 0  # times a bucket closed because drafting lost (reported as a stat)
        self.won: set[int] = set()  # buckets whose last judgement found drafting faster
        self._last: tuple[bool, int] | None = None

    @staticmethod
    def bucket(n: int) -> int:
        return max(1, n).bit_length()

    def allows(self, n: int) -> bool:
        b = self.bucket(n)
        if b not in self.closed_until:  # never seen: decode plainly first, to know what drafting competes with
            self._close(b, MEASURE_STEPS, measure=True)
        elif self.step >= self.closed_until[b] and b in self.pause and self.plain_rate(b) is None:
            # closed by a smaller bucket's loss before any step of its own: measure decoding here before a probe,
            # or the probe's verify steps (the dearest there are, at this batch size) are judged against nothing
            self._close(b, MEASURE_STEPS, measure=True)
        return self.step >= self.closed_until[b]

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
        plain = self.plain_rate(b)
        short = s.steps >= PROBE_STEPS and (b in self.pause or (plain is not None and s.rate < EARLY_LOSS * plain))
        if s.steps < JUDGE_STEPS and not short:
            return
        if plain is None:  # nothing to compare with: decode plainly for a stretch
            self._close(b, MEASURE_STEPS, measure=True)
        elif s.rate < plain:
            # a first loss pauses for as many steps as make a probe that loses as much (PROBE_STEPS + the switch)
            # cost PROBE_SHARE of the decoding time between probes; each further loss doubles the pause
            probe = (PROBE_STEPS + 1) * s.lost_per_step(plain)
            first = min(max(probe / (PROBE_SHARE * self.closed[b].step_seconds), FIRST_PAUSE), MAX_PAUSE)
            last = self.lost.get(b, self.pause.get(b))  # its own last pause, else one a smaller bucket's loss set
            self.pause[b] = self.lost[b] = int(min(2 * last if last else first, MAX_PAUSE))
            self._close(b, self.pause[b])
            self.closures += 1
            self.won.discard(b)
            for larger in range(b + 1, _MAX_BUCKET + 1):  # larger batches gain less: closed as long, unless they won
                if larger not in self.won and self.closed_until.get(larger, 0) < self.closed_until[b]:
                    self.pause[larger] = max(self.pause.get(larger, 0), self.pause[b])
                    self._close(larger, self.pause[b], measure=True)
        else:
            self.won.add(b)
            self.pause.pop(b, None)
            # One won stretch may be the host's noise: the next loss pauses half as long as the last, not
            # FIRST_PAUSE again; wins in a row forget the losses.
            if b in self.lost:
                self.lost[b] //= 2
                if self.lost[b] < FIRST_PAUSE:
                    del self.lost[b]
            self.opened[b] = Stretch()  # judge the next stretch on its own
            if self.step >= self.refresh_at.setdefault(b, self.step + REFRESH_EVERY):
                self._close(b, MEASURE_STEPS, measure=True)

    def _close(self, b: int, steps: int, measure: bool = False) -> None:
        self.closed_until[b] = self.step + steps
        self.opened[b] = Stretch()
        self.closed[b] = Stretch()  # decoding is measured afresh in every closed stretch
        if measure:
            self.refresh_at[b] = self.step + steps + REFRESH_EVERY
