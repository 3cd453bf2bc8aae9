"""The step record rank 0 sends the other tensor-parallel ranks before each forward, as one int64 array.

A record says what to do (run a forward, or stop), the batch (`BatchSpec`), the request-table writes made since
the last record (merged into one (rows, columns, slots) triple, a cell written twice keeping its last value), and
the sampled ids rank 0 has broadcast over the device group since then (overlap scheduling: each worker joins
those broadcasts, in order, before anything else). Pickling the same record took several hundred microseconds
on the host's critical path of every step; filling an array takes a few.

Layout: a header of _HEADER int64 values, then input ids, positions, request rows, sequence lengths, KV slots,
logits rows (if any), extend prefix and new lengths (extend only), the writes' rows, columns and slots, and the
futures' (count, dtype code) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixlm.srt.model_executor.forward_batch import BatchSpec, ForwardMode

FORWARD, STOP = 1, 2
_HEADER = 10
_DTYPES = [torch.int64, torch.int32]  # a future's dtype, by its code


@dataclass
class StepRecord:
    kind: int
    spec: BatchSpec | None
    writes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, columns, slots (int64)
    futures: list[tuple[int, torch.dtype]]  # (ids, dtype) of each broadcast, in order


def merge_writes(journal: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ReqToTokenPool journal entries as one (rows, columns, slots) triple in which every cell appears once, with
    the value written last (one scatter on the receiving side applies them all)."""
    rows, cols, slots = [], [], []
    for method, args in journal:
        if method == "write":
            idx, start, s = args
            s = s.numpy().astype(np.int64, copy=False)
            rows.append(np.full(len(s), idx, dtype=np.int64))
            cols.append(np.arange(start, start + len(s), dtype=np.int64))
            slots.append(s)
        elif method == "write_many":
            r, c, s = (t.numpy().astype(np.int64, copy=False) for t in args)
            rows.append(r)
            cols.append(c)
            slots.append(s)
        else:
            raise ValueError(f"unknown request-table write {method!r}")
    if not rows:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    r, c, s = np.concatenate(rows), np.concatenate(cols), np.concatenate(slots)
    if len(journal) > 1:  # the same cell may have been written twice (a row freed and reused between steps)
        key = r * (int(c.max()) + 1) + c
        _, last = np.unique(key[::-1], return_index=True)
        keep = np.sort(len(key) - 1 - last)
        r, c, s = r[keep], c[keep], s[keep]
    return r, c, s


def encode(kind: int, spec: BatchSpec | None, journal: list, futures: list[tuple[int, torch.dtype]]) -> np.ndarray:
    r, c, s = merge_writes(journal)
    parts: list = []
    if spec is not None:
        parts += [spec.input_ids, spec.positions, spec.req_pool_indices, spec.seq_lens, spec.out_cache_loc.numpy()]
        if spec.logits_indices is not None:
            parts.append(spec.logits_indices)
        if spec.extend_prefix_lens is not None:
            parts += [spec.extend_prefix_lens, spec.extend_seq_lens]
    parts += [r, c, s, [v for n, dtype in futures for v in (n, _DTYPES.index(dtype))]]
    payload = [np.asarray(p, dtype=np.int64).ravel() for p in parts]
    header = np.array(
        [
            0,  # total length, filled below
            kind,
            int(spec.mode) if spec is not None else 0,
            len(spec.input_ids) if spec is not None else 0,
            spec.batch_size if spec is not None else 0,
            len(spec.out_cache_loc) if spec is not None else 0,
            -1 if spec is None or spec.logits_indices is None else len(spec.logits_indices),
            int(spec is not None and spec.extend_prefix_lens is not None),
            len(r),
            len(futures),
        ],
        dtype=np.int64,
    )
    out = np.concatenate([header, *payload])
    out[0] = len(out)
    return out


def decode(buf: np.ndarray) -> StepRecord:
    kind, mode, n, bs, n_loc, n_logits, extend, n_writes, n_futures = (int(v) for v in buf[1:_HEADER])
    at = _HEADER

    def take(k: int) -> np.ndarray:
        nonlocal at
        at += k
        return buf[at - k : at]

    spec = None
    if kind == FORWARD:
        ids, pos, rows, lens = take(n).tolist(), take(n).tolist(), take(bs).tolist(), take(bs).tolist()
        loc = torch.from_numpy(take(n_loc).copy())
        logits = take(n_logits).tolist() if n_logits >= 0 else None
        prefix, new = (take(bs).tolist(), take(bs).tolist()) if extend else (None, None)
        spec = BatchSpec(ForwardMode(mode), ids, pos, rows, lens, loc, logits, prefix, new)
    writes = None
    if n_writes:
        writes = tuple(torch.from_numpy(take(n_writes).copy()) for _ in range(3))
    flat = take(2 * n_futures).tolist()
    futures = [(flat[i], _DTYPES[flat[i + 1]]) for i in range(0, len(flat), 2)]
    return StepRecord(kind, spec, writes, futures)


class StepChannel:
    """Records over a gloo group: one broadcast of a fixed-size buffer when the record fits it (every decode step
    of up to several hundred requests), a second one of the exact size when it does not (long prefills)."""

    def __init__(self, group, capacity: int = 4096):
        self.group = group
        self.buf = torch.zeros(capacity, dtype=torch.int64)
        self.view = self.buf.numpy()

    def send(self, record: np.ndarray) -> None:
        import torch.distributed as dist

        n = len(record)
        if n <= len(self.buf):
            self.view[:n] = record
            dist.broadcast(self.buf, src=0, group=self.group)
            return
        self.view[0] = -n  # too large: the record follows on its own
        dist.broadcast(self.buf, src=0, group=self.group)
        dist.broadcast(torch.from_numpy(record), src=0, group=self.group)

    def recv(self) -> np.ndarray:
        import torch.distributed as dist

        dist.broadcast(self.buf, src=0, group=self.group)
        n = int(self.view[0])
        if n > 0:
            return self.view[:n].copy()
        big = torch.empty(-n, dtype=torch.int64)
        dist.broadcast(big, src=0, group=self.group)
        return big.numpy()
