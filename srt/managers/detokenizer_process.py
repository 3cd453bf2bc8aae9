"""The detokenizer process: token ids from the scheduler in, text deltas to the tokenizer manager out."""

from __future__ import annotations

import logging
import sys
import traceback

import msgspec
import zmq

from radixlm.srt.cpu_guard import CpuGuard, read_lost_ticks
from radixlm.srt.managers.detokenizer import IncrementalDetokenizer
from radixlm.srt.managers.io_struct import BatchStrOutput, BatchTokenOutput
from radixlm.srt.utils import configure_logging, die_with_parent, freeze_startup_objects, parent_alive

logger = logging.getLogger(__name__)


def run_detokenizer_process(log_level: str, endpoints: dict, parent_pid: int, setup, ready) -> None:
    """`setup`: a pipe on which the server process sends {"tokenizer": its tokenizer (pickled on the way),
    "cpu_guard": whether to guard this loop's CPU}, or which it closes when it failed to load one."""
    die_with_parent()
    configure_logging(log_level, "[detokenizer] ")
    started = read_lost_ticks()
    try:
        try:
            given = setup.recv()
        except EOFError:
            sys.exit(1)  # the server process could not load the tokenizer; it reports why and stops
        finally:
            setup.close()
        cpu_guard = given["cpu_guard"]
        detok = IncrementalDetokenizer(given["tokenizer"])
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(endpoints["detokenizer"])
        send = ctx.socket(zmq.PUSH)
        send.connect(endpoints["tokenizer"])
    except Exception as e:
        ready.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    ready.send({"status": "ready"})
    decoder = msgspec.msgpack.Decoder(BatchTokenOutput)
    encoder = msgspec.msgpack.Encoder()
    freeze_startup_objects()
    # every token passes through this loop too: keep it off CPUs that interrupts take time from (CpuGuard)
    guard = CpuGuard("detokenizer", since=started) if cpu_guard else None
    try:
        while True:
            if guard is not None:
                guard.tick()
            if not recv.poll(500):
                if not parent_alive(parent_pid):
                    return
                continue
            batch = decoder.decode(recv.recv())
            for out in batch.outputs:
                if out.detok is not None and out.rid not in detok.states:
                    detok.register(out.rid, **out.detok)
            items = [msgspec.structs.replace(d.out, delta=d.delta, detok=None) for d in detok.process(batch.outputs)]
            if items:
                send.send(encoder.encode(BatchStrOutput(items)))
    except Exception:
        logger.error("detokenizer crashed:\n%s", traceback.format_exc())
        sys.exit(1)
