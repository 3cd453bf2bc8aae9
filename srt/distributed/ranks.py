"""Serving with tensor parallelism: one decision per step.

Rank 0 runs the only scheduler (admission, radix cache, grammar masks, sampling). Before each forward it
broadcasts a step record over a gloo group (step_record.py): the batch (`BatchSpec`) and the request-table
writes made since the last step (the slot numbers the attention kernels read). Ranks 1..N-1 run `worker_loop`:
apply the writes, run the same forward, whose all-reduces and all-gather pair with rank 0's. Nothing a worker
computes on its own can change a batch. Workers start with rank 0 (`spawn_ranks`), build their shard the same
way and capture the same graphs, and die with it; rank 0 watches them (`watch_workers`) and ends the server
when one dies.

Under overlap scheduling a step's input ids may be the previous step's sampled ids, still on the device
(futures): the next record announces them and rank 0 broadcasts them over the device group right after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback

import torch

from radixlm._net import free_local_port
from radixlm.srt.distributed.parallel import SINGLE, TensorParallel, init_tensor_parallel
from radixlm.srt.distributed.step_record import FORWARD, STOP, StepChannel, decode, encode

logger = logging.getLogger(__name__)

_IDLE = datetime.timedelta(days=30)  # a worker waits for the next step as long as the server is up


def free_init_addr() -> str:
    return f"tcp://127.0.0.1:{free_local_port()}"


def backend_for(device: str) -> str:
    return "gloo" if device == "cpu" or (device == "auto" and not torch.cuda.is_available()) else "nccl"


def batch_digest(runner, spec) -> str:
    """What a rank is about to compute, in 16 hex digits: the batch and this rank's request-table entries for it
    (what its attention kernels will read)."""
    h = hashlib.blake2b(digest_size=8)
    for part in (spec.mode.name, spec.input_ids, spec.positions, spec.req_pool_indices, spec.seq_lens,
                 spec.logits_indices, spec.extend_prefix_lens, spec.extend_seq_lens):  # fmt: skip
        h.update(repr(part).encode())
    h.update(spec.out_cache_loc.numpy().tobytes())
    table = runner.req_to_token_pool.host
    for row, n in zip(spec.req_pool_indices, spec.seq_lens):
        h.update(table[row, :n].numpy().tobytes())
    return h.hexdigest()


def check_batch(runner, spec, control) -> None:
    """--tp-check-batches: every rank's digest of the step, compared on every rank; a difference is an error
    naming the ranks (their next collective would otherwise mix different batches, or hang)."""
    import torch.distributed as dist

    mine = batch_digest(runner, spec)
    digests = [None] * dist.get_world_size(control)
    dist.all_gather_object(digests, mine, group=control)
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(
            f"tensor-parallel ranks disagree on the batch they are about to run (ranks {odd} differ from rank 0: "
            f"{digests}); a rank-local state changed a step"
        )


class StepSender:
    """Rank 0's side: every forward of its runner is first announced to the workers."""

    def __init__(self, runner, tp: TensorParallel, control, procs: list):
        self.runner, self.tp, self.procs = runner, tp, procs
        self.control = control
        self.channel = StepChannel(control)
        self.dead: str | None = None  # set by watch_workers
        self.stopped = False
        self.journal: list = []
        self.futures: list[torch.Tensor] = []  # sampled ids stored since the last announcement
        runner.req_to_token_pool.journal = self.journal
        runner.step_hook = self

    def _send(self, kind: int, spec=None) -> list[torch.Tensor]:
        """Announce a record; returns the futures it carries, for the caller to broadcast next."""
        if self.dead is not None and kind != STOP:
            raise RuntimeError(self.dead)
        futures, self.futures = self.futures, []
        record = encode(kind, spec, self.journal, [(ids.shape[0], ids.dtype) for ids in futures])
        self.journal[:] = []
        self.channel.send(record)
        return futures

    def before_forward(self, spec) -> None:
        """The runner's hook: announce the step to the workers before rank 0 runs it."""
        import torch.distributed as dist

        for ids in self._send(FORWARD, spec):  # the workers join these broadcasts before the forward
            dist.broadcast(ids, src=0, group=self.tp.group)
        if self.runner.server_args.tp_check_batches:
            check_batch(self.runner, spec, self.control)

    def on_futures(self, ids: torch.Tensor) -> None:
        """The runner's hook for the overlap scheduler's sampled ids, which a later step reads on the device.
        Rank 0 keeps them at once; the workers get them by a broadcast right after the next announcement, which
        tells them to expect it (so nothing on rank 0's device waits for a worker that has not been told)."""
        self.futures.append(ids.contiguous())

    def stop(self) -> None:
        self.stopped = True
        try:
            self._send(STOP)  # futures not yet announced are dropped on both sides
        except Exception:  # noqa: BLE001 - a worker already gone
            pass
        # Leave the groups together with the workers, which do so on STOP: NCCL's teardown waits for every rank
        # of a communicator, so rank 0 must not first wait for the workers to exit (they wait for it there).
        release_graphs(self.runner)
        leave_groups(timeout_s=15)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def worker_loop(runner, control, tp_group) -> None:
    """Ranks 1..N-1: run rank 0's forwards (and keep its sampled ids where the next steps read them) until it
    says stop."""
    import torch.distributed as dist

    pool, channel = runner.req_to_token_pool, StepChannel(control)
    while True:
        rec = decode(channel.recv())
        if rec.kind == STOP:
            return
        if rec.writes is not None:
            pool.write_many(*rec.writes)
        for n, dtype in rec.futures:
            ids = torch.empty(n, dtype=dtype, device=runner.device)
            dist.broadcast(ids, src=0, group=tp_group)
            runner.store_futures(ids)
        if runner.server_args.tp_check_batches:
            check_batch(runner, rec.spec, control)
        runner.run_forward(rec.spec)


def _worker_main(rank: int, size: int, init: str, args, model_path, tokenizer_path, parent_pid: int) -> None:
    from radixlm.srt.utils import configure_logging, die_with_parent

    die_with_parent()
    configure_logging(args.log_level, f"[tp rank {rank}] ")
    try:
        tp, control = join(size, rank, init, args)
        loaded, runner = build_runner(args, model_path, tokenizer_path, tp)
        gather_rank_reports(runner, control)
        worker_loop(runner, control, tp.group)
        release_graphs(runner)
        leave_groups(timeout_s=15)
    except Exception:  # the log names the rank; rank 0 sees the exit and ends the server
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        sys.exit(1)


def leave_groups(timeout_s: float) -> bool:
    """Destroy this process's groups; False when that did not end within `timeout_s` (a peer that died mid-way can
    hold NCCL's teardown forever: the process then goes on, or exits, without it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - logged: a group left registered stops the next one in this process
            logger.warning("tensor-parallel teardown failed:\n%s", traceback.format_exc())

    start = time.monotonic()
    t = threading.Thread(target=destroy, name="tp-teardown", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        logger.warning("tensor-parallel groups did not tear down within %.0f s; going on without", timeout_s)
    else:
        logger.debug("tensor-parallel groups left in %.2f s", time.monotonic() - start)
    return not t.is_alive() and not dist.is_initialized()


def release_graphs(runner) -> None:
    """Destroy the runner's CUDA graphs: graphs that captured NCCL collectives keep their communicators' teardown
    waiting (both ranks stuck in ncclCommFinalize polling for the graphs' plans to be reclaimed) until they are
    destroyed, which dropping a reference does not guarantee."""
    if runner.graphs is not None:
        runner.graphs.release()
        runner.graphs = None


def rank_report(runner) -> dict:
    """This rank's place and memory once its model, KV pool and graphs are built (the KV pool is allocated up
    front, so this is what the rank holds while serving): GPU memory in use on its device, or the process's
    resident memory on a CPU rank."""
    dev = runner.device
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        used = total - free
    else:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "rank": runner.tp.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(dev),
        "memory_used_bytes": int(used),
        "memory_total_bytes": int(total),
    }


def gather_rank_reports(runner, control) -> list[dict]:
    """Every rank's rank_report, in rank order (all ranks call it at the same point of start-up)."""
    import torch.distributed as dist

    out: list = [None] * runner.tp.size
    dist.all_gather_object(out, rank_report(runner), group=control)
    return out


def local_ranks(args) -> range:
    """The ranks this host runs: tp_size / nnodes consecutive ones per host."""
    per = args.tp_size // args.nnodes
    return range(args.node_rank * per, (args.node_rank + 1) * per)


def rank_device(args, rank: int) -> str:
    """A GPU rank runs on cuda:i, i its index among its host's ranks (of the devices CUDA_VISIBLE_DEVICES
    shows)."""
    return f"cuda:{rank - local_ranks(args).start}" if backend_for(args.device) == "nccl" else args.device


def join(size: int, rank: int, init: str, args) -> tuple[TensorParallel, object]:
    import torch.distributed as dist

    if backend_for(args.device) == "nccl":
        torch.cuda.set_device(rank_device(args, rank))
    tp = init_tensor_parallel(size, rank, init, backend_for(args.device), args.dist_timeout)
    if backend_for(args.device) == "nccl" and args.nnodes == 1 and not args.disable_custom_all_reduce:
        from radixlm.srt.distributed.fused_all_reduce import setup

        tp = dataclasses.replace(tp, fused=setup(tp, torch.device(rank_device(args, rank))))
    control = dist.new_group(backend="gloo", timeout=_IDLE)  # step records: CPU objects, waited on while idle
    return tp, control


def build_runner(args, model_path, tokenizer_path, tp: TensorParallel):
    from radixlm.srt.model_executor.model_runner import ModelRunner
    from radixlm.srt.model_loader.loader import load_model

    loaded = load_model(
        model_path,
        tokenizer_path=tokenizer_path,
        dtype=args.dtype,
        device=rank_device(args, tp.rank),
        context_length=args.context_length,
        served_model_name=args.served_model_name,
        load_format=args.load_format,
        quantization=args.quantization,
        fp8_lm_head=args.fp8_lm_head,
        tp=tp,
    )
    return loaded, ModelRunner(loaded, args)


def start_ranks(args, model_path, tokenizer_path, exit_on_rank_death: bool = False):
    """Rank 0's model and runner; with tp_size > 1 the workers are started first and a StepSender ships every
    forward to them. Returns (loaded, runner, sender or None). `exit_on_rank_death`: the server's scheduler
    process ends when a worker rank dies (see watch_workers)."""
    if args.tp_size == 1:
        loaded, runner = build_runner(args, model_path, tokenizer_path, SINGLE)
        runner.rank_reports = [rank_report(runner)]
        return loaded, runner, None
    check_layout(args, model_path)
    init = init_address(args)
    procs = spawn_ranks(args, [r for r in local_ranks(args) if r != 0], init, model_path, tokenizer_path)
    try:
        tp, control = join(args.tp_size, 0, init, args)
        loaded, runner = build_runner(args, model_path, tokenizer_path, tp)
        runner.rank_reports = gather_rank_reports(runner, control)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    sender = StepSender(runner, tp, control, procs)
    watch_workers(sender, exit_on_rank_death)
    return loaded, runner, sender


def init_address(args) -> str:
    init = args.dist_init_addr or free_init_addr()
    return init if init.startswith(("tcp://", "file://")) else f"tcp://{init}"


def spawn_ranks(args, ranks, init: str, model_path, tokenizer_path) -> list:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(rank, args.tp_size, init, args, model_path, tokenizer_path, os.getpid()),
            name=f"radixlm-tp{rank}",
            daemon=True,
        )
        for rank in ranks
    ]
    for p in procs:
        p.start()
    return procs


def run_worker_node(args, model_path, tokenizer_path) -> int:
    """A host other than node 0 (--node-rank k > 0): its ranks only, and a /health stub on --host:--port that
    answers 200 while they all run. Returns the exit code: 0 once rank 0 has stopped them, 1 when one failed."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    check_layout(args, model_path)
    procs = spawn_ranks(args, list(local_ranks(args)), init_address(args), model_path, tokenizer_path)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            ok = self.path == "/health" and all(p.is_alive() for p in procs)
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"ranks not running")

        def log_message(self, *_):
            pass

    http = ThreadingHTTPServer((args.host, args.port), Health)
    threading.Thread(target=http.serve_forever, name="health", daemon=True).start()
    logger.info("node %d of %d: ranks %s, /health on %s:%d", args.node_rank, args.nnodes, list(local_ranks(args)),
                args.host, args.port)  # fmt: skip
    try:
        while True:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                bad = [p.name for p in procs if p.exitcode not in (None, 0)]
                logger.error("tensor-parallel %s exited with an error; stopping this node", ", ".join(bad))
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        http.shutdown()
        for p in procs:
            if p.is_alive():
                p.kill()


def check_layout(args, model_path) -> None:
    """Configurations that cannot run, refused before any rank starts: a model whose heads, KV heads or MLP
    columns do not split tp_size ways, more ranks than visible GPUs."""
    from radixlm.srt.model_loader.loader import open_checkpoint

    cfg = open_checkpoint(model_path, dummy=args.load_format == "dummy")[0].config
    for rank in range(args.tp_size):
        tp = TensorParallel(size=args.tp_size, rank=rank)
        tp.even(cfg.num_heads, "attention heads")
        tp.kv_heads(cfg.num_kv_heads)
        tp.even(cfg.intermediate_size, "MLP columns")
    per = args.tp_size // args.nnodes
    if backend_for(args.device) == "nccl" and torch.cuda.device_count() < per:
        raise ValueError(f"{per} ranks on this host need as many GPUs; {torch.cuda.device_count()} are visible")


def watch_workers(sender: StepSender, exit_process: bool, interval_s: float = 0.5) -> None:
    """When a worker rank dies, its peers would wait for it in the next collective. In the server's scheduler
    process (`exit_process`) that ends the process, non-zero; in an in-process Engine the next step raises."""

    def watch():
        while not sender.stopped:
            for p in sender.procs:
                if p.exitcode is not None and p.exitcode != 0:
                    sender.dead = f"tensor-parallel rank {p.name} exited with {p.exitcode}"
                    logger.error("%s; stopping", sender.dead)
                    for q in sender.procs:
                        if q.is_alive():
                            q.kill()
                    if exit_process:
                        os._exit(1)
                    return
            time.sleep(interval_s)

    threading.Thread(target=watch, name="tp-watch", daemon=True).start()
