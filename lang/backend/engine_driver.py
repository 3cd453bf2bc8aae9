"""One thread that owns an in-process Engine: jobs from any thread are added as they come and stepped
together, so concurrent program branches share batches (and the radix cache) as they would on a server."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from radixlm.lang.backend.base import LangError

_DONE = object()


@dataclass
class _Cancel:
    """The caller stopped reading a job's stream: abort its requests."""

    job: "_Job"


@dataclass
class _Control:
    """A call on the engine that must not race a step (flush_cache, get_stats): run between steps."""

    fn: object
    result: queue.Queue = field(default_factory=queue.Queue)


@dataclass
class _Job:
    payload: dict
    updates: queue.Queue = field(default_factory=queue.Queue)  # progress dicts, then a list or an exception
    rids: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)


class EngineDriver:
    def __init__(self, engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.owner: dict[str, _Job] = {}
        self.aborted: set[str] = set()  # cancelled requests the engine has yet to report finished
        self._stopped = False
        self.thread = threading.Thread(target=self._loop, name="radixlm-engine-driver", daemon=True)
        self.thread.start()

    # --- callers -----------------------------------------------------------------------------------------
    def run(self, payload: dict) -> list[dict]:
        out = None
        for item in self._submit(payload):
            out = item
        return out

    def stream(self, payload: dict) -> Iterator[dict]:
        for item in self._submit(payload):
            if isinstance(item, list):
                return
            yield item

    def call(self, fn):
        """`fn()` on the driver thread, between engine steps; returns its result."""
        if self._stopped:
            raise LangError("the engine backend is shut down")
        ctl = _Control(fn)
        self.inbox.put(ctl)
        out = ctl.result.get()
        if isinstance(out, BaseException):
            raise out
        return out

    def _submit(self, payload: dict):
        if self._stopped:
            raise LangError("the engine backend is shut down")
        job = _Job(payload)
        self.inbox.put(job)
        finished = False
        try:
            while True:
                item = job.updates.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if isinstance(item, list):
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:  # closed early (a stop_regex matched): free the engine of it
                self.inbox.put(_Cancel(job))

    def stop(self) -> None:
        self._stopped = True
        self.inbox.put(_DONE)
        self.thread.join(timeout=30)

    # --- the driver thread ---------------------------------------------------------------------------------
    def _add(self, job: _Job) -> None:
        p = job.payload
        try:
            job.rids = self.engine.add_request(
                prompt=p["text"],
                sampling_params=p.get("sampling_params"),
                return_logprob=p.get("return_logprob", False),
                top_logprobs_num=p.get("top_logprobs_num", 0),
                logprob_start_len=p.get("logprob_start_len", -1),
            )
        except Exception as e:  # a bad request fails its caller only
            job.updates.put(LangError(f"the engine refused the request: {e}"))
            return
        for rid in job.rids:
            self.owner[rid] = job

    def _loop(self) -> None:
        while True:
            block = not self.owner and not self.aborted
            try:
                while True:
                    job = self.inbox.get(block=block)
                    block = False
                    if job is _DONE:
                        self._fail_all(LangError("the engine backend is shut down"))
                        return
                    if isinstance(job, _Cancel):
                        self._cancel(job.job)
                    elif isinstance(job, _Control):
                        self._control(job)
                    else:
                        self._add(job)
            except queue.Empty:
                pass
            if not self.owner and not self.aborted:
                continue
            try:
                updates = self.engine.step()
            except Exception as e:  # the engine broke: every caller hears it
                self._fail_all(LangError(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            for u in updates:
                job = self.owner.get(u["meta_info"]["id"])
                if job is None:
                    if u["finished"]:
                        self.aborted.discard(u["meta_info"]["id"])
                    continue
                if job.payload.get("stream"):
                    job.updates.put(u)
                if u["finished"]:
                    rid = u["meta_info"]["id"]
                    del self.owner[rid]
                    job.results[rid] = u
                    if len(job.results) == len(job.rids):
                        job.updates.put([job.results[r] for r in job.rids])

    def _cancel(self, job: _Job) -> None:
        for rid in job.rids:
            if self.owner.pop(rid, None) is not None and self.engine.abort(rid):
                self.aborted.add(rid)  # stepped until its final update (finish reason abort), which is dropped

    def _control(self, ctl: _Control) -> None:
        try:
            ctl.result.put(ctl.fn())
        except Exception as e:
            ctl.result.put(LangError(f"the engine failed: {type(e).__name__}: {e}"))

    def _fail_all(self, err: Exception) -> None:
        for job in {id(j): j for j in self.owner.values()}.values():
            job.updates.put(err)
        for rid in list(self.owner):
            self.engine.abort(rid)
        self.owner.clear()
