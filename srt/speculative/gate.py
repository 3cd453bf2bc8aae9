"""Whether drafting pays at the current batch size, from what steps measured on this machine.

A verify step costs more than a decode step of the same requests (each draft token is a row of the forward, and
under the overlap scheduler a speculative step also runs in order); it pays only when the accepted tokens
outweigh that. How much more it costs depends on the device, the model and the batch: on a GPU a verify step of
a small model measured 2.6-4x a decode step, on a CPU every extra row costs compute. So the scheduler does not
guess a batch size: for each batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps the tokens per second that
decode steps and verify steps delivered, and while verify steps deliver fewer, nobody drafts at that size. A
closed bucket is probed again after a pause that doubles each time the probe loses (32 steps up to 1,024), so a
workload that turns copy-heavy is noticed and free text pays little for the probes; the decode rate of a bucket
where drafting keeps winning is re-measured now and then, as contexts grow and steps slow down.

Only steady iterations count: one whose step was of the same kind and bucket as the iteration before it (the
first step after a switch also drains or refills the overlap pipeline, which is neither kind's own cost)."""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3  # weight of a new sample in a rate's moving average
FIRST_PAUSE = 32  # steps a losing bucket waits before its first probe
MAX_PAUSE = 1024
PROBE_SAMPLES = 2  # steady verify samples a (re)opened bucket takes before it may close again
PLAIN_SAMPLES = 3  # steady decode samples a bucket needs before verify is compared with it
REFRESH_EVERY = 512  # steps between forced re-measurements of a bucket's decode rate while drafting wins


@dataclass
class Rate:
    value: float = 0.0
    samples: int = 0  # since the bucket last changed state (opened, or closed to measure)

    def add(self, x: float) -> None:
        self.value = x if self.samples == 0 else (1 - ALPHA) * self.value + ALPHA * x
        self.samples += 1


class SpecGate:
    def __init__(self):
        self.step = 0
        self.decode: dict[int, Rate] = {}
        self.verify: dict[int, Rate] = {}
        self.closed_until: dict[int, int] = {}
        self.pause: dict[int, int] = {}
        self.refresh_at: dict[int, int] = {}
        self.closures = 0  # times a bucket closed because verify steps lost (reported as a stat)
        self._last: tuple[str, int] | None = None

    @staticmethod
    def bucket(n: int) -> int:
        return max(1, n).bit_length()

    def allows(self, n: int) -> bool:
        return self.step >= self.closed_until.get(self.bucket(n), 0)

    def observe(self, kind: str | None, n: int, tokens: int, seconds: float) -> None:
        """One scheduler iteration: `kind` "decode" (an overlapped or plain decode step of n requests) or "verify"
        (a speculative step), `tokens` the tokens it gave, `seconds` its wall time; None for anything else (an
        extend, an in-order decode under overlap), which only breaks the chain of steady iterations."""
        self.step += 1
        key = None if kind is None else (kind, self.bucket(n))
        steady, self._last = key is not None and key == self._last, key
        if not steady or seconds <= 0 or tokens <= 0:
            return
        b = self.bucket(n)
        if kind == "decode":
            self.decode.setdefault(b, Rate()).add(tokens / seconds)
            return
        spec = self.verify.setdefault(b, Rate())
        spec.add(tokens / seconds)
        plain = self.decode.get(b)
        if plain is None or plain.samples < PLAIN_SAMPLES:
            if spec.samples >= 2 * PROBE_SAMPLES:  # nothing to compare with: decode plainly for a few steps
                self._close(b, 2 * PLAIN_SAMPLES, measure=True)
            return
        if spec.samples < PROBE_SAMPLES:
            return
        if spec.value < plain.value:
            self.pause[b] = min(2 * self.pause.get(b, FIRST_PAUSE // 2), MAX_PAUSE)
            self._close(b, self.pause[b])
            self.closures += 1
        else:
            self.pause.pop(b, None)
            if self.step >= self.refresh_at.setdefault(b, self.step + REFRESH_EVERY):
                self._close(b, 2 * PLAIN_SAMPLES, measure=True)

    def _close(self, b: int, steps: int, measure: bool = False) -> None:
        self.closed_until[b] = self.step + steps
        self.verify[b].samples = 0  # the next probe is judged on its own steps
        if measure:
            self.decode.pop(b, None)
            self.refresh_at[b] = self.step + steps + REFRESH_EVERY
