"""Host <-> device transfers of a step without stalling the host.

Device -> host: the one transfer per step, a flat float64 packet copied into pinned memory without blocking,
with an event the host waits on only when it needs the values (one step later under overlap scheduling).

Host -> device: the step's small uploads (slot tables, sampling parameters, attention metadata) go through one
pinned ring allocated at start-up (`upload`, `pinned_empty`). A copy from pageable memory makes the driver wait
for the stream to drain first, which would undo overlap scheduling; and pinning memory per call (a tensor's
`pin_memory()`) goes to the driver, which pins pages under a global lock that other CUDA calls take too: the
scheduler thread can stall milliseconds inside such an upload (vLLM saw the same in `pin_memory()`).
"""

from __future__ import annotations

import threading
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
            buf = self.buffers[i] = torch.empty(
                max(n, 2 * (buf.numel() if buf is not None else 0), 8192), dtype=torch.float64, pin_memory=True
            )
        host = buf[:n]
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingCopy(host, event)


class PinnedRing:
    """Pinned host memory for uploads, handed out in order from CHUNKS equal chunks. Leaving a chunk records an
    event after the copies from it, on the stream they were enqueued on (a chunk serves one stream: an upload
    on another stream moves on to the next chunk first); the chunk is handed out again only once that event has
    passed, CHUNKS - 1 chunks later (long done: a step's uploads are a few KB). A region is valid until its copy
    is enqueued."""

    CHUNKS = 8
    ALIGN = 64

    def __init__(self, nbytes: int = 8 << 20, pin: bool = True, fence=None, current_stream=None):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.chunk = nbytes // self.CHUNKS
        self.fence = fence or _record_event  # (stream) -> an object with synchronize(), after the copies so far
        self.current_stream = current_stream or torch.cuda.current_stream
        self.fences: list = [None] * self.CHUNKS
        self.current = 0
        self.used = 0
        self.stream = None  # the stream the current chunk's copies go to
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of pinned memory (uint8), or None when that is more than a chunk."""
        if nbytes > self.chunk:
            return None
        stream = self.current_stream()
        with self.lock:
            if self.used and (self.used + nbytes > self.chunk or stream != self.stream):
                self.fences[self.current] = self.fence(self.stream)
                self.current = (self.current + 1) % self.CHUNKS
                self.used = 0
                if self.fences[self.current] is not None:
                    self.fences[self.current].synchronize()
            self.stream = stream
            start = self.current * self.chunk + self.used
            self.used += -(-nbytes // self.ALIGN) * self.ALIGN
        return self.buf[start : start + nbytes]


def _record_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


_rings: dict[int, PinnedRing] = {}


def _ring(device: torch.device) -> PinnedRing:
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _rings.get(index)
    if ring is None:
        ring = _rings[index] = PinnedRing()
    return ring


def pinned_empty(shape: tuple[int, ...] | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor to fill and then upload to CUDA `device` at once (pinned; from the ring when it fits)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    region = _ring(device).take(nbytes) if nbytes else None
    if region is None:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return region.view(dtype).view(shape)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on CUDA `device`, copied without blocking the host (see the module's note)."""
    if host.is_pinned():
        return host.to(device, non_blocking=True)
    staged = pinned_empty(tuple(host.shape), host.dtype, device)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
