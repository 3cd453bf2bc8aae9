"""The step record rank 0 sends the other tensor-parallel ranks: every field of a batch survives the round trip,
request-table writes merge with the last write of a cell winning, and records reach another process over a
real gloo group whether they fit the channel's buffer or not."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from radixlm.srt.distributed.step_record import FORWARD, STOP, StepChannel, decode, encode, merge_writes
from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode


def _extend_spec() -> BatchSpec:
    return BatchSpec(
        ForwardMode.EXTEND,
        input_ids=[5, -3, 7, 8, 9],  # a future (negative) among them
        positions=[40, 0, 1, 2, 3],
        req_pool_indices=[2, 6],
        seq_lens=[41, 4],
        out_cache_loc=torch.tensor([100, 7, 8, 9, 10]),
        logits_indices=[0, 4],
        extend_prefix_lens=[40, 0],
        extend_seq_lens=[1, 4],
    )


def _decode_spec(bs: int) -> BatchSpec:
    return BatchSpec(
        ForwardMode.DECODE,
        [-(i + 1) for i in range(bs)],
        [500 + i for i in range(bs)],
        list(range(bs)),
        [501 + i for i in range(bs)],
        torch.arange(1000, 1000 + bs),
    )


def _same(a: BatchSpec, b: BatchSpec) -> bool:
    fields = ("mode", "input_ids", "positions", "req_pool_indices", "seq_lens", "logits_indices",
              "extend_prefix_lens", "extend_seq_lens")  # fmt: skip
    return all(getattr(a, f) == getattr(b, f) for f in fields) and torch.equal(a.out_cache_loc, b.out_cache_loc)


def test_round_trip_of_every_field():
    journal = [("write", (6, 0, torch.tensor([7, 8, 9, 10], dtype=torch.int32)))]
    futures = [(3, torch.int64), (2, torch.int32)]
    for spec in (_extend_spec(), _decode_spec(5)):
        rec = decode(encode(FORWARD, spec, journal, futures))
        assert rec.kind == FORWARD and _same(rec.spec, spec)
        assert rec.futures == futures
        rows, cols, slots = rec.writes
        assert rows.tolist() == [6] * 4 and cols.tolist() == [0, 1, 2, 3] and slots.tolist() == [7, 8, 9, 10]
    stop = decode(encode(STOP, None, [], []))
    assert stop.kind == STOP and stop.spec is None and stop.writes is None and stop.futures == []


def test_a_cell_written_twice_keeps_its_last_value():
    journal = [
        ("write", (3, 0, torch.tensor([10, 11, 12]))),
        ("write_many", (torch.tensor([3, 4]), torch.tensor([1, 0]), torch.tensor([21, 40]))),
        ("write", (3, 2, torch.tensor([32]))),
    ]
    r, c, s = merge_writes(journal)
    got = {(int(a), int(b)): int(v) for a, b, v in zip(r, c, s)}
    assert got == {(3, 0): 10, (3, 1): 21, (3, 2): 32, (4, 0): 40}
    assert len(r) == len(got)  # one scatter with no duplicate cell


def _rank(rank: int, init: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, world_size=2, rank=rank, timeout=datetime.timedelta(seconds=60))
    try:
        channel = StepChannel(dist.group.WORLD, capacity=64)  # small: the 200-request batch overflows it
        records = [encode(FORWARD, _extend_spec(), [], []), encode(FORWARD, _decode_spec(200), [], [])]
        if rank == 0:
            for r in records:
                channel.send(r)
        else:
            torch.save([channel.recv() for _ in records], out)
    finally:
        dist.destroy_process_group()


def test_records_reach_another_rank_in_or_over_the_buffer(tmp_path):
    out = tmp_path / "got.pt"
    mp.start_processes(_rank, args=(f"file://{tmp_path / 'rdv'}", str(out)), nprocs=2, start_method="spawn")
    got = [decode(a) for a in torch.load(out, weights_only=False)]
    assert _same(got[0].spec, _extend_spec()) and _same(got[1].spec, _decode_spec(200))
