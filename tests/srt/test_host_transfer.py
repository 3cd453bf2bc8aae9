"""The pinned upload ring: regions never overlap a copy that may still be pending, and uploads arrive intact."""

import pytest
import torch

from radixlm.srt.model_executor.host_transfer import PinnedRing, upload


class _Fence:
    def __init__(self, log: list):
        self.log = log
        self.id = len([e for e in log if e[0] == "record"])
        log.append(("record", self.id))

    def synchronize(self):
        self.log.append(("wait", self.id))


def test_ring_hands_out_aligned_regions_and_waits_before_reusing_a_chunk():
    log: list = []
    ring = PinnedRing(8 * 1024, pin=False, fence=lambda stream: _Fence(log), current_stream=lambda: "s")  # 8 x 1 KB
    base = ring.buf.data_ptr()
    starts = []
    for _ in range(8 * 4):  # four 200-byte regions per chunk (each rounded up to 256)
        region = ring.take(200)
        assert region.numel() == 200
        starts.append(region.data_ptr() - base)
    assert all(s % PinnedRing.ALIGN == 0 for s in starts)
    assert len(set(starts)) == len(starts) and max(starts) < 8 * 1024  # once round: no region reused
    assert [e for e in log if e[0] == "wait"] == []  # no chunk had been used before
    assert len(log) == 7  # a fence on leaving each of the first seven chunks
    again = ring.take(200)  # the eighth chunk is full: back to the first, after its fence has passed
    assert again.data_ptr() == base
    assert log[-2:] == [("record", 7), ("wait", 0)]
    assert ring.take(1025) is None  # more than a chunk: the caller pins its own


def test_ring_gives_each_stream_its_own_chunk():
    """A fence recorded on one stream says nothing of copies on another: a chunk never mixes streams."""
    log: list = []
    streams = iter(["a", "a", "b", "b", "a"])
    fenced = []
    ring = PinnedRing(
        8 * 1024,
        pin=False,
        fence=lambda stream: fenced.append(stream) or _Fence(log),
        current_stream=lambda: next(streams),
    )
    chunks = [(ring.take(64).data_ptr() - ring.buf.data_ptr()) // ring.chunk for _ in range(5)]
    assert chunks == [0, 0, 1, 1, 2]
    assert fenced == ["a", "b"]  # each chunk's fence on the stream its copies went to


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and copies need a CUDA device")
def test_uploads_arrive_intact_while_the_device_is_busy():
    dev = torch.device("cuda")
    torch.cuda._sleep(50_000_000)  # the copies queue behind this while the host refills the ring many times over
    sources = [torch.randint(-(2**40), 2**40, (n,), dtype=torch.int64) for n in range(1, 3000, 7)] * 40
    sources += [torch.rand(5, 77), torch.tensor([True, False, True]), torch.arange(10, dtype=torch.int32)[::2]]
    outs = [upload(s, dev) for s in sources]
    for s, o in zip(sources, outs):
        assert o.device.type == "cuda" and o.dtype == s.dtype and torch.equal(o.cpu(), s)
