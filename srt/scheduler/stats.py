"""What the scheduler counts (reported by /get_server_info and /metrics) and what its last step was."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which served from the radix cache at first admission
    computed_prefill_tokens: int = 0  # tokens run through extend (including re-prefills after retraction)
    generated_tokens: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0  # extend steps that carried running requests' decode tokens
    retractions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    busy_seconds: float = 0.0
    # Speculative decoding: verify steps, request-steps with a draft, draft tokens, draft tokens accepted.
    spec_verify_steps: int = 0
    spec_drafting_requests: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_in_order_steps: int = 0  # overlap: steps run in order to look for drafts (speculative/pacer.py)
    spec_looks_skipped: int = 0  # overlap: looks not run, the host's tokens matching nothing (Drafter.may_draft)
    spec_gate_closures: int = 0  # times a batch-size bucket stopped drafting because drafting lost (gate.py)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_accept_length(self) -> float:
        """Tokens a drafting request gained per verify step: its accepted draft tokens plus the one sampled."""
        if not self.spec_drafting_requests:
            return 0.0
        return (self.spec_accepted_tokens + self.spec_drafting_requests) / self.spec_drafting_requests


@dataclass
class StepInfo:
    """The batch a step scheduled."""

    mode: str  # "extend", "decode" or "verify" (speculative)
    batch_size: int  # requests computing new tokens (prompts or chunks; every request for decode)
    tokens: int  # tokens computed (prompt tokens for extend, not counting riders)
    decode_riders: int = 0  # running requests decoding inside an extend batch (mixed chunks, prefill budget)
    sampled_early: bool = False  # overlap: sampling was launched with the forward (nothing waited for)
    started: float = field(default_factory=time.perf_counter)

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["started"]
        return d
