"""KV memory: a request->token slot table and the per-layer K/V slot pools (page size 1)."""

from __future__ import annotations

import torch

from radixlm.srt.utils import to_device


class ReqToTokenPool:
    """Row per running request; row[i] is the KV slot of that request's token i.

    The scheduler reads slots back (to hand them to the radix tree) from a host mirror, so bookkeeping never
    waits on the device; on a CPU device the mirror is the table itself.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device):
        self.size = size
        self.max_context_len = max_context_len
        # One extra row, never handed out and always zeros: the padding rows of a CUDA-graph batch point at it,
        # so they attend to slot 0 (the padding slot) only.
        self.dummy_row = size
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.host = (
            self.req_to_token if device.type == "cpu" else torch.zeros((size + 1, max_context_len), dtype=torch.int32)
        )
        self._free = list(range(size - 1, -1, -1))
        # Under tensor parallelism rank 0 records its writes here, for the other ranks' copies of the table.
        self.journal: list | None = None

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)

    def available_size(self) -> int:
        return len(self._free)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        if self.journal is not None:
            self.journal.append(("write", (idx, start, slots.clone())))
        self.host[idx, start : start + len(slots)] = slots
        if self.host is not self.req_to_token:
            self.req_to_token[idx, start : start + len(slots)] = to_device(
                slots.to(torch.int32), self.req_to_token.device
            )

    def write_many(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], cols[i]] = slots[i] (host tensors)."""
        if self.journal is not None:
            self.journal.append(("write_many", (rows.clone(), cols.clone(), slots.clone())))
        self.host[rows, cols] = slots.to(torch.int32)
        if self.host is not self.req_to_token:
            packed = to_device(torch.stack([rows, cols, slots.to(torch.int64)]), self.req_to_token.device)
            self.req_to_token[packed[0], packed[1]] = packed[2].to(torch.int32)

    def slots(self, idx: int, length: int) -> torch.Tensor:
        return self.host[idx, :length].to(torch.int64)

    def slot_range(self, idx: int, start: int, end: int) -> torch.Tensor:
        """A view of row idx's slots start..end-1 (int32, the host table's): copy it to keep it."""
        return self.host[idx, start:end]


# Freed pieces kept apart before they are joined into one (bounds the list; joining them costs what they hold).
_MAX_FREED_PIECES = 1024


class TokenToKVPool:
    """K and V of every layer in two tensors [layers, slots + 1, kv_heads, head_dim]; slot 0 is padding.

    The free list lives on the host: allocation is scheduler bookkeeping and must never sync the device.
    An e4m3 pool holds K / k_scale[layer] and V / v_scale[layer]; the scales are fixed before the first request
    (ModelRunner's calibration), since every stored token depends on them.
    """

    def __init__(
        self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        self.size = size
        self.dtype = dtype
        self.device = device
        shape = (num_layers, size + 1, num_kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.is_fp8 = dtype == torch.float8_e4m3fn
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        # Freed slots wait here and join the free list only when an allocation needs them: appending to one
        # tensor on every free copied the whole list (O(pool) per finish or rejected draft: milliseconds for
        # the millions of slots a large card's pool has).
        self._freed: list[torch.Tensor] = []
        self._freed_n = 0

    def available_size(self) -> int:
        return len(self._free) + self._freed_n

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free):
            if n > self.available_size():
                return None
            self._merge()
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if len(slots):
            # a copy: the caller's tensor may be a view of a table whose row is reused
            self._freed.append(slots.to("cpu", torch.int64, copy=True))
            self._freed_n += len(slots)
            if len(self._freed) >= _MAX_FREED_PIECES:
                self._freed = [torch.cat(self._freed)]

    def free_slots(self) -> torch.Tensor:
        self._merge()
        return self._free

    def _merge(self) -> None:
        if self._freed:
            self._free = torch.cat([self._free, *self._freed])
            self._freed, self._freed_n = [], 0

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        from radixlm.kernels.rope import store_rows, to_cache

        store_rows(self.k_buffer[layer_id], loc, to_cache(k, self.k_buffer, self.k_scale[layer_id]))
        store_rows(self.v_buffer[layer_id], loc, to_cache(v, self.v_buffer, self.v_scale[layer_id]))

    def scales(self, layer_id: int) -> dict[str, float]:
        """The K and V scales of a layer as keyword arguments of the store and attention kernels."""
        return {"k_scale": self.k_scale[layer_id], "v_scale": self.v_scale[layer_id]}
