"""The scheduler process: the scheduler core in a ZMQ loop (one per GPU rank)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import msgspec
import torch
import zmq

from radixlm.srt import env
from radixlm.srt.cpu_guard import CpuGuard, cpu_list, guard_wanted, read_lost_ticks
from radixlm.srt.distributed.ranks import start_ranks
from radixlm.srt.errors import RadixLMError
from radixlm.srt.managers.io_struct import (
    AbortReq,
    BatchTokenOutput,
    ControlReq,
    ControlResp,
    FinishReason,
    GenerateReq,
    SchedulerIn,
    TokenOutput,
)
from radixlm.srt.managers.request_prep import stop_token_ids
from radixlm.srt.model_loader.loader import LoadedModel
from radixlm.srt.sampling.sampling_params import SamplingParams
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.scheduler import Scheduler
from radixlm.srt.server_args import ServerArgs
from radixlm.srt.utils import configure_logging, die_with_parent, parent_alive

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle scheduler wakes to check that its parent is still there


def run_scheduler_process(
    args: ServerArgs, model_path: str, tokenizer_path: str, endpoints: dict, parent_pid: int, ready
) -> None:
    die_with_parent()
    configure_logging(args.log_level, "[scheduler] ")
    started = read_lost_ticks()  # the CPU guard's first window: the whole start-up
    if args.scheduler_cpus not in ("auto", "none"):
        os.sched_setaffinity(0, cpu_list(args.scheduler_cpus))
        logger.info("scheduler pinned to CPUs %s", args.scheduler_cpus)
    try:
        loaded, runner, ranks = start_ranks(args, model_path, tokenizer_path, exit_on_rank_death=True)
        if runner.device.type == "cuda" and not env.OMP_NUM_THREADS.is_set():
            # Host tensors here are bookkeeping (slot lists, sampling parameters). A pool of OpenMP threads
            # spinning after each parallel op would take cores from the other server processes and stall this
            # loop (as vLLM, one thread unless the operator says otherwise).
            torch.set_num_threads(1)
        scheduler = Scheduler(runner, loaded.tokenizer, args)
    except Exception as e:  # report why, then exit non-zero: the launcher shows the message
        ready.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        sys.exit(1)
    loop = SchedulerLoop(scheduler, loaded, endpoints, parent_pid)
    if guard_wanted(args.scheduler_cpus, str(runner.device)):
        # the loop stalls the device whenever it loses its CPU (on CPU only the forward's own threads matter)
        loop.cpu_guard = CpuGuard("scheduler", since=started)
    ready.send(
        {
            "status": "ready",
            "context_length": runner.context_length,
            "max_total_tokens": runner.max_total_tokens,
            "max_running_requests": runner.max_running_requests,
            "vocab_size": runner.vocab_size,
            "eos_token_ids": loaded.config.eos_token_ids,
            "device": str(runner.device),
            "dtype": str(runner.dtype),
            "architecture": loaded.config.architecture,
            "load_seconds": loaded.load_seconds,
            "pid": os.getpid(),
            "quantization": loaded.quantization,
        }
    )
    if ranks is not None:
        # The launcher stops this process with SIGTERM: finish the step, then stop the other ranks cleanly
        # (a rank on another host would otherwise see its peer vanish and fail).
        signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "running", False))
    try:
        loop.run()
    except Exception:
        logger.error("scheduler crashed:\n%s", traceback.format_exc())
        sys.exit(1)
    finally:
        if ranks is not None:
            ranks.stop()


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, loaded: LoadedModel, endpoints: dict, parent_pid: int):
        self.scheduler = scheduler
        self.step = scheduler.step
        self.trace = None
        if env.STEP_TRACE.get():  # opt-in: the diagnostics room is imported only then
            from radixlm.srt.diagnostics.step_trace import StepTrace, trace_path

            self.trace = StepTrace(trace_path(env.STEP_TRACE.get()))
            self.step = self.trace.wrap(scheduler)
        self.profiler = None  # a torch.profiler run asked for over HTTP (srt/diagnostics/profiler.py)
        self.eos_ids = loaded.config.eos_token_ids
        self.parent_pid = parent_pid
        ctx = zmq.Context()
        self.recv = ctx.socket(zmq.PULL)
        self.recv.bind(endpoints["scheduler"])
        self.to_detok = ctx.socket(zmq.PUSH)
        self.to_detok.connect(endpoints["detokenizer"])
        self.to_tokenizer = ctx.socket(zmq.PUSH)
        self.to_tokenizer.connect(endpoints["tokenizer"])
        self.decoder = msgspec.msgpack.Decoder(SchedulerIn)
        self.encoder = msgspec.msgpack.Encoder()
        self.running = True
        self.cpu_guard: CpuGuard | None = None

    def run(self) -> None:
        while self.running:
            busy = self.scheduler.has_work()
            if self.recv.poll(0 if busy else _IDLE_POLL_MS):
                self._drain()
            if not busy and not parent_alive(self.parent_pid):
                logger.warning("launcher is gone; scheduler exits")
                return
            if self.cpu_guard is not None:
                self.cpu_guard.tick()
            if self.scheduler.has_work():
                outputs = self.step()
                if outputs:
                    self.to_detok.send(self.encoder.encode(BatchTokenOutput(outputs)))
                if self.profiler is not None:
                    self.profiler.step()

    def _drain(self) -> None:
        while True:
            try:
                raw = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self.decoder.decode(raw)
            if isinstance(msg, GenerateReq):
                self._add(msg)
            elif isinstance(msg, AbortReq):
                self.scheduler.abort(msg.rid)
            elif isinstance(msg, ControlReq):
                self._control(msg)

    def _add(self, msg: GenerateReq) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            req = Req(
                rid=msg.rid,
                input_ids=msg.input_ids,
                sampling_params=params,
                seed=msg.seed,
                stop_token_ids=stop_token_ids(params, self.eos_ids),
                return_logprob=msg.return_logprob,
                top_logprobs_num=msg.top_logprobs_num,
                logprob_start_len=msg.logprob_start_len,
                stream=msg.stream,
                grammar_spec=params.grammar(),
            )
            self.scheduler.add(req)
        except RadixLMError as e:  # the tokenizer manager checks first; this is the backstop
            reason = FinishReason.abort(e.message, e.status, e.param)
            out = TokenOutput(
                rid=msg.rid,
                new_ids=[],
                prompt_tokens=len(msg.input_ids),
                completion_tokens=0,
                cached_tokens=0,
                finished_reason=reason,
                detok={},
            )
            self.to_detok.send(self.encoder.encode(BatchTokenOutput([out])))

    def _control(self, msg: ControlReq) -> None:
        if msg.kind == "flush_cache":
            resp = ControlResp(msg.id, self.scheduler.flush_cache())
            if self.trace is not None:  # a quiet moment: write the trace out (servers are killed, not exited)
                self.trace.flush()
        elif msg.kind == "get_stats":
            stats = self.scheduler.get_stats()
            if self.cpu_guard is not None:
                stats["cpu_guard"] = self.cpu_guard.state()
            resp = ControlResp(msg.id, True, stats)
        elif msg.kind == "shutdown":
            self.running = False
            resp = ControlResp(msg.id, True)
        elif msg.kind in ("start_profile", "stop_profile"):
            resp = self._profile(msg)
        else:
            resp = ControlResp(msg.id, False, f"unknown control request {msg.kind!r}")
        self.to_tokenizer.send(self.encoder.encode(resp))

    def _profile(self, msg: ControlReq) -> ControlResp:
        """start_profile (args: output_dir, num_steps, activities, record_shapes) or stop_profile; a refusal
        (already running, nothing to stop, an unusable directory or activity) is ok=False with the reason."""
        from radixlm.srt.diagnostics.profiler import ProfileError, StepProfiler

        if self.profiler is None:
            self.profiler = StepProfiler()
        try:
            if msg.kind == "start_profile":
                a = msg.args or {}
                info = self.profiler.start(
                    a.get("output_dir"),
                    a.get("num_steps"),
                    a.get("activities"),
                    bool(a.get("record_shapes", False)),
                )
                return ControlResp(msg.id, True, info)
            return ControlResp(msg.id, True, self.profiler.stop())
        except ProfileError as e:
            return ControlResp(msg.id, False, str(e))
        except Exception as e:  # noqa: BLE001 - a profiler fault answers the request; it never ends the loop
            logger.exception("%s failed", msg.kind)
            return ControlResp(msg.id, False, f"{msg.kind} failed: {type(e).__name__}: {e}")
