"""The one device->host transfer per step: a flat float64 packet copied into pinned memory without blocking,
with an event the host waits on only when it needs the values (one step later under overlap scheduling)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_RING = 3  # staging buffers in rotation; at most two packets are ever unread


@dataclass
class PendingCopy:
    host: torch.Tensor
    event: torch.cuda.Event | None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class HostStaging:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * _RING
        self.next = 0

    def copy(self, flat: torch.Tensor) -> PendingCopy:
        if not self.cuda:
            return PendingCopy(flat, None)
        n = flat.numel()
        i = self.next
        self.next = (i + 1) % _RING
        buf = self.buffers[i]
        if buf is None or buf.numel() < n:
            buf = self.buffers[i] = torch.empty(max(n, 2 * (buf.numel() if buf is not None else 0), 8192),
                                                dtype=torch.float64, pin_memory=True)
        host = buf[:n]
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingCopy(host, event)
