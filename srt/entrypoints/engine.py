"""The in-process Engine: the offline batch API, driving the scheduler core directly (no processes)."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterator

import torch

from radixlm.srt.distributed.ranks import start_ranks
from radixlm.srt.errors import InvalidRequest
from radixlm.srt.managers.detokenizer import IncrementalDetokenizer
from radixlm.srt.managers.io_struct import spec_meta
from radixlm.srt.managers.request_prep import (
    PreparedInput,
    check_logprob_args,
    expand,
    normalize_inputs,
    per_prompt_params,
    tokenize,
)
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.scheduler import Scheduler
from radixlm.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model_path=None, **server_args)`: every ServerArgs field is a keyword argument."""

    def __init__(self, model_path: str | None = None, **kwargs):
        unknown = sorted(set(kwargs) - ServerArgs.field_names())
        if unknown:
            raise TypeError(f"Engine() got unknown argument(s): {', '.join(unknown)}")
        self.server_args = args = ServerArgs(model_path=model_path, **kwargs)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.manual_seed(args.random_seed)
        self.loaded, self.runner, self._ranks = start_ranks(args, args.model_path, args.tokenizer_path)
        self.tokenizer = self.loaded.tokenizer
        self.scheduler = Scheduler(self.runner, self.tokenizer, args)
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self._rng = random.Random(args.random_seed)
        self._ids = itertools.count()
        self._state: dict[str, dict] = {}  # per unfinished request: output ids, logprobs, start time
        self._undelivered: list[dict] = []
        self._profiler = None  # start_profile's torch.profiler run (srt/diagnostics/profiler.py)

    # --- generation ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        rid=None,
    ):
        """Text or token ids, single or batch. Returns a dict (a list for a batch or n > 1), or with
        stream=True an iterator of dicts whose `text` grows."""
        rids, batched = self._submit(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len, stream, rid
        )
        if stream:
            return self._follow(rids)
        results = {item["meta_info"]["id"]: item for item in self._follow(rids) if item["finished"]}
        ordered = [results[r] for r in rids]
        return ordered if batched or len(ordered) > 1 else ordered[0]

    def chat(self, messages: list[dict], sampling_params=None, **kwargs):
        """Apply the model's chat template to `messages` and generate the assistant's reply."""
        return self.generate(input_ids=self.chat_ids(messages), sampling_params=sampling_params, **kwargs)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    # --- step-level API (what generate() is built on) ----------------------------------------------------
    def add_request(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        rid=None,
    ) -> list[str]:
        """Queue requests without running them; returns their ids (one per prompt and sample)."""
        return self._submit(
            prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len, False, rid
        )[0]

    def step(self) -> list[dict]:
        """Run one scheduler step; returns a progress dict for every request that advanced or finished."""
        updates, self._undelivered = self._undelivered, []
        return updates + self._step_once()

    def abort(self, rid: str) -> bool:
        """Stop a request; the next step() reports it finished with reason `abort`."""
        return self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._state)

    def _submit(
        self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len, stream, rid
    ) -> tuple[list[str], bool]:
        prompts, batched = normalize_inputs(prompt, input_ids)
        params = per_prompt_params(sampling_params, len(prompts))
        check_logprob_args(return_logprob, top_logprobs_num, logprob_start_len)
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if len(rids) != len(prompts):
            raise InvalidRequest(f"got {len(rids)} rids for {len(prompts)} prompts", param="rid")
        eos = self.loaded.config.eos_token_ids
        reqs: list[Req] = []
        for p, sp, r in zip(prompts, params, rids):
            ids, text = tokenize(self.tokenizer, p)
            reqs += expand(
                PreparedInput(ids, text, sp),
                rid=r if r is not None else f"engine-{next(self._ids)}",
                eos_ids=eos,
                rng=self._rng,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs_num,
                logprob_start_len=logprob_start_len,
                stream=stream,
                grammar_backend=self.server_args.grammar_backend,
            )
        taken = [r.rid for r in reqs if r.rid in self._state]
        if taken or len({r.rid for r in reqs}) != len(reqs):
            raise InvalidRequest(f"request id {(taken or [reqs[0].rid])[0]!r} is already in use", param="rid")
        for r in reqs:  # all or nothing: a bad request in a batch enqueues none of it
            self.scheduler.validate(r)
        now = time.perf_counter()
        for r in reqs:
            p = r.sampling_params
            self.detokenizer.register(
                r.rid,
                skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens,
                stop=p.stop,
                no_stop_trim=p.no_stop_trim,
            )
            self.scheduler.add(r)
            self._state[r.rid] = {"ids": [], "logprobs": {}, "start": now}
        return [r.rid for r in reqs], batched

    def _step_once(self) -> list[dict]:
        outputs = self.scheduler.step()
        if self._profiler is not None:
            self._profiler.step()
        if not outputs and self._state and not self.scheduler.has_work():
            raise RuntimeError("scheduler went idle with requests pending")
        updates = []
        for d in self.detokenizer.process(outputs):
            s = self._state.get(d.rid)
            if s is None:
                continue
            out = d.out
            s["ids"] += out.new_ids
            _merge_logprobs(s["logprobs"], out)
            reason = out.finished_reason
            if reason is not None:
                del self._state[d.rid]
            updates.append(
                {
                    "text": d.text,
                    "output_ids": list(s["ids"]),
                    "finished": reason is not None,
                    "meta_info": {
                        "id": d.rid,
                        "finish_reason": reason and reason.to_dict(),
                        "prompt_tokens": out.prompt_tokens,
                        "completion_tokens": out.completion_tokens,
                        "cached_tokens": out.cached_tokens,
                        "e2e_latency": time.perf_counter() - s["start"],
                        **s["logprobs"],
                        **(spec_meta(out.spec) if out.spec is not None else {}),
                    },
                }
            )
        return updates

    def _follow(self, rids: list[str]) -> Iterator[dict]:
        """Step until `rids` finish, yielding their updates; others' updates wait for the next step() call."""
        pending = set(rids)
        try:
            while pending:
                for item in self._step_once():
                    rid = item["meta_info"]["id"]
                    if rid not in pending:
                        self._undelivered.append(item)
                        continue
                    if item["finished"]:
                        pending.discard(rid)
                    yield item
            # Under overlap scheduling a step launched for requests that have just finished may still be in
            # flight: run it out when nothing else is outstanding, so that the engine is idle (and their KV
            # free) once the call returns.
            while not self._state and self.scheduler.has_work():
                self._undelivered += self._step_once()
        finally:
            for rid in pending:  # the caller stopped early or a step failed: free what they held
                self.scheduler.abort(rid, notify=False)
                self.detokenizer.discard(rid)
                self._state.pop(rid, None)

    # --- management ----------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    def start_profile(
        self, output_dir: str | None = None, num_steps: int | None = None, activities=None, record_shapes=False
    ) -> dict:
        """A torch.profiler run of the steps that follow, as the server's POST /start_profile: until
        stop_profile() or `num_steps` steps; ValueError (ProfileError) if one runs already or an argument is
        unusable."""
        from radixlm.srt.diagnostics.profiler import StepProfiler

        if self._profiler is None:
            self._profiler = StepProfiler()
        return self._profiler.start(output_dir, num_steps, activities, record_shapes)

    def stop_profile(self) -> dict:
        """Ends the profile and writes it: {"trace", "summary", "steps", "seconds"} (ProfileError if none ran)."""
        from radixlm.srt.diagnostics.profiler import ProfileError

        if self._profiler is None:
            raise ProfileError("no profile is running: start_profile() first")
        return self._profiler.stop()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker ranks, if any (with one rank nothing runs in the background)."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _merge_logprobs(acc: dict, out) -> None:
    if out.input_logprobs is not None:
        acc["input_token_logprobs"] = list(out.input_logprobs)
    if out.output_logprobs is not None:
        acc.setdefault("output_token_logprobs", []).extend(out.output_logprobs)
    if out.output_top_logprobs is not None:
        acc.setdefault("output_top_logprobs", []).extend(out.output_top_logprobs)
