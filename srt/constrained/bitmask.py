"""Token bitmasks on the device: unconstrained rows are all ones; constrained rows come from matchers."""

from __future__ import annotations

import torch


def allocate(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token whose bit is 0 set to -inf (bitmask [B, ceil(V / 32)] int32, same device)."""
    b, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(b, -1)[:, :v].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> list[int]:
    """The token ids bitmask[row] allows (tests and small checks)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask[row].cpu().unsqueeze(-1) >> shifts) & 1).view(-1)[:vocab_size]
    return bits.nonzero().view(-1).tolist()
