"""The scheduler room: the core that steps (scheduler.py) and its phases, split by concern.

scheduler.py  Scheduler: add / abort / step, the plain and the overlap loop over the phases below
prefill.py    admission: which waiting requests (and which chunk) join the next extend batch
decode.py     the decode batch, and retraction when KV runs out
batch.py      requests -> a batch (KV slots, the runner's BatchSpec, sampling parameters)
output.py     a processed step: tokens appended, finish checks, jump-forward, outputs to stream
grammar.py    the grammar queue, batch masks, token acceptance
kv.py         a request's KV slots between the free list, the radix tree and its private tail
policy.py     the waiting queue's order
process.py    the scheduler process: the core in a ZMQ loop
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.srt.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]


def __getattr__(name: str):
    # Lazily, so that importing one module of the room (req.py, say) does not import the whole scheduler.
    if name == "Scheduler":
        from radixlm.srt.scheduler.scheduler import Scheduler

        return Scheduler
    raise AttributeError(name)
