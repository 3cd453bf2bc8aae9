"""Launch the server: start the scheduler and detokenizer processes, wait until both are ready, then serve HTTP.

If a child dies, the server logs why, fails what is in flight and exits non-zero within seconds. SIGINT/SIGTERM
shut everything down and remove the private socket directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time

from radixlm.srt.errors import RadixLMError
from radixlm.srt.server_args import ServerArgs
from radixlm.srt.utils import configure_logging, freeze_startup_objects

logger = logging.getLogger("radixlm.launch")

_READY_TIMEOUT_S = 600
_WATCHDOG_PERIOD_S = 0.25
_DEATH_GRACE_S = 1.0  # after a child dies: keep answering (503) this long so clients learn why, then exit


class ServerProcesses:
    """The scheduler and detokenizer children and their private ipc:// socket directory."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.ipc_dir = tempfile.mkdtemp(prefix="radixlm-ipc-")
        self.endpoints = {name: f"ipc://{self.ipc_dir}/{name}" for name in ("scheduler", "detokenizer", "tokenizer")}
        self.procs: dict[str, mp.Process] = {}
        self.stopping = False

    def start(self, model_path: str, tokenizer_path: str, tokenizer: concurrent.futures.Future) -> dict:
        """Start both children and wait until they are ready. `tokenizer`: this process's tokenizer, loading.

        The detokenizer gets a pickled copy of it instead of loading its own: transformers' AutoTokenizer imports
        torch (seconds of CPU that would compete with the scheduler's model load), while unpickling imports only
        the tokenizer's class, and the copy is the very object the HTTP side tokenizes with."""
        from radixlm.srt.cpu_guard import guard_wanted

        ctx = mp.get_context("spawn")
        pid = os.getpid()
        pipes = {}
        setup_recv, setup_send = ctx.Pipe(duplex=False)
        targets = {
            "scheduler": (_run_scheduler, (self.args, model_path, tokenizer_path, self.endpoints, pid)),
            "detokenizer": (_run_detokenizer, (self.args.log_level, self.endpoints, pid, setup_recv)),
        }
        for name, (fn, fn_args) in targets.items():
            recv, send = ctx.Pipe(duplex=False)
            # A tensor-parallel scheduler starts its worker ranks itself, which a daemonic process may not do; it
            # dies with this process all the same (die_with_parent).
            daemon = not (name == "scheduler" and self.args.tp_size > 1)
            proc = ctx.Process(target=fn, args=(*fn_args, send), name=f"radixlm-{name}", daemon=daemon)
            proc.start()
            send.close()
            self.procs[name], pipes[name] = proc, recv
        setup_recv.close()
        try:
            try:
                tok = tokenizer.result()
            except Exception as e:  # noqa: BLE001 - any failure to load is the server's failure to start
                raise RuntimeError(f"cannot load the tokenizer from {tokenizer_path}: {e}") from e
            # torch is imported by now (transformers' AutoTokenizer imports it), so asking for CUDA costs nothing
            setup_send.send({"tokenizer": tok, "cpu_guard": guard_wanted(self.args.scheduler_cpus, self.args.device)})
        finally:
            setup_send.close()  # the detokenizer, if not sent its setup, sees the pipe closed and exits
        info = {}
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for name, pipe in pipes.items():
            msg = self._wait_ready(name, pipe, deadline)
            if msg.get("status") != "ready":
                raise RuntimeError(f"the {name} process failed to start: {msg.get('message', 'no reason given')}")
            info.update({k: v for k, v in msg.items() if k != "status"})
        return info

    def _wait_ready(self, name: str, pipe, deadline: float) -> dict:
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if pipe.poll(0.2):
                try:
                    return pipe.recv()
                except EOFError:
                    break
            if not proc.is_alive():
                break
        if proc.is_alive():
            raise RuntimeError(f"the {name} process did not become ready within {_READY_TIMEOUT_S} s")
        return {"status": "error", "message": f"it exited with code {proc.exitcode}"}

    def dead_child(self) -> str | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"the {name} process exited unexpectedly (exit code {proc.exitcode})"
        return None

    def alive(self) -> bool:
        return self.dead_child() is None

    def stop(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _run_scheduler(*args) -> None:
    """The scheduler child's entry: its modules (torch, the model) are imported in the child, not here."""
    from radixlm.srt.scheduler.process import run_scheduler_process

    run_scheduler_process(*args)


def _run_detokenizer(*args) -> None:
    from radixlm.srt.managers.detokenizer_process import run_detokenizer_process

    run_detokenizer_process(*args)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def launch_server(args: ServerArgs) -> int:
    """Run the server until SIGINT/SIGTERM (returns 0) or until a child process dies (returns 1)."""
    configure_logging(args.log_level)
    # Nothing before the children start imports torch (the model resolves from its files alone, and the children
    # import their own modules), so they start at once; this process loads torch with its tokenizer meanwhile.
    from radixlm.srt.model_loader.resolve import resolve_model

    try:
        resolved = resolve_model(args.model_path, args.tokenizer_path, args.served_model_name, args.load_format)
    except RadixLMError as e:
        logger.error("cannot load the model: %s", e)
        return 2
    if args.node_rank > 0:  # a host that only runs tensor-parallel ranks
        from radixlm.srt.distributed.ranks import run_worker_node

        try:
            return run_worker_node(args, resolved.model_path, resolved.tokenizer_path)
        except (ValueError, KeyboardInterrupt) as e:
            logger.error("%s", e)
            return 1
    # CPython 3.11 can fail an AST conversion that runs while another thread converts one ("SystemError: AST
    # constructor recursion depth mismatch", python/cpython#106905). anyio builds its lazy-import map that way
    # when first imported, and both the tokenizer's imports (transformers -> huggingface_hub) and the HTTP app's
    # (fastapi -> starlette) reach it: it is imported here, before the tokenizer's thread starts (~20 ms).
    import anyio.abc  # noqa: F401

    # The HTTP side's tokenizer loads (importing torch through transformers) while the children start, off the
    # path to the first answer.
    loading = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load")
    tokenizer_future = loading.submit(_load_tokenizer, resolved.tokenizer_path)
    loading.shutdown(wait=False)
    procs = ServerProcesses(args)
    try:
        info = procs.start(resolved.model_path, resolved.tokenizer_path, tokenizer_future)
    except (RuntimeError, KeyboardInterrupt) as e:
        logger.error("%s", e)
        procs.stop()
        return 1
    info["tokenizer_path"] = resolved.tokenizer_path
    info["process_ids"] = {"http": os.getpid(), **{name: p.pid for name, p in procs.procs.items()}}
    from radixlm import __version__

    info["version"] = __version__
    import uvicorn

    from radixlm.srt.entrypoints.http_server import create_app
    from radixlm.srt.managers.tokenizer_manager import TokenizerManager
    from radixlm.srt.metrics import Metrics

    tokenizer = tokenizer_future.result()
    tm = TokenizerManager(args, tokenizer, info, procs.endpoints, Metrics(resolved.served_model_name))
    exit_code = {"value": 0, "served": False}
    server: uvicorn.Server | None = None

    async def watchdog():
        while not procs.stopping:
            reason = procs.dead_child()
            if reason:
                logger.error("%s; failing requests in flight and shutting down", reason)
                tm.fail_all(reason)
                exit_code["value"] = 1
                await asyncio.sleep(_DEATH_GRACE_S)
                server.should_exit = True
                return
            await asyncio.sleep(_WATCHDOG_PERIOD_S)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await tm.start()
        freeze_startup_objects()  # the tokenizer, app and imports
        exit_code["served"] = True
        task = asyncio.create_task(watchdog())
        logger.info(
            "radixlm ready: %s on http://%s:%d (%s, %s, KV cache %d tokens)",
            resolved.served_model_name,
            args.host,
            args.port,
            info["device"],
            info["dtype"],
            info["max_total_tokens"],
        )
        yield
        procs.stopping = True
        task.cancel()

    app = create_app(tm, args, info, resolved.served_model_name, resolved.model_path, procs.alive, lifespan)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        access_log=args.log_level == "debug",
    )
    server = uvicorn.Server(config)
    # uvicorn handles SIGINT/SIGTERM while serving and re-raises the signal once it has stopped; by then the
    # shutdown is ours to finish (children, sockets, exit code), so the re-raised signal must do nothing.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        procs.stop()
    if not exit_code["served"]:
        return 1  # e.g. the port was taken
    return exit_code["value"]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="radixlm serve", description="Launch the radixlm HTTP server.")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
    # Until uvicorn installs its own handlers, SIGTERM interrupts start-up like Ctrl-C so children are cleaned up.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.dp_size > 1:
        from radixlm.srt.router.launch import run_data_parallel

        sys.exit(run_data_parallel(list(sys.argv[1:] if argv is None else argv), args))
    sys.exit(launch_server(args))


def _interrupt(signum, frame):
    raise KeyboardInterrupt
