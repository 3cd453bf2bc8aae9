"""The in-process Engine: the offline batch API, driving the scheduler core directly (no processes)."""
from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterator

import torch

from radixlm.srt.managers.detokenizer import IncrementalDetokenizer
from radixlm.srt.managers.req import Req
from radixlm.srt.managers.request_prep import (PreparedInput, check_logprob_args, expand, normalize_inputs,
                                               per_prompt_params, tokenize)
from radixlm.srt.managers.scheduler import Scheduler
from radixlm.srt.model_executor.model_runner import ModelRunner
from radixlm.srt.model_loader.loader import load_model
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
        self.loaded = load_model(args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
                                 device=args.device, context_length=args.context_length,
                                 served_model_name=args.served_model_name)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded, args)
        self.scheduler = Scheduler(self.runner, self.tokenizer, args)
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self._rng = random.Random(args.random_seed)
        self._ids = itertools.count()

    # --- generation ----------------------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, *, return_logprob: bool = False,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1, stream: bool = False, rid=None):
        """Text or token ids, single or batch. Returns a dict (a list for a batch or n > 1), or with
        stream=True an iterator of dicts whose `text` grows."""
        reqs, batched = self._prepare(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num,
                                      logprob_start_len, stream, rid)
        if stream:
            return self._stream(reqs)
        results = {}
        for item in self._drive(reqs):
            if item["meta_info"]["finish_reason"] is not None:
                results[item["meta_info"]["id"]] = item
        ordered = [results[r.rid] for r in reqs]
        return ordered if batched or len(ordered) > 1 else ordered[0]

    def chat(self, messages: list[dict], sampling_params=None, **kwargs):
        """Apply the model's chat template to `messages` and generate the assistant's reply."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return self.generate(input_ids=list(ids), sampling_params=sampling_params, **kwargs)

    def _prepare(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len,
                 stream, rid) -> tuple[list[Req], bool]:
        prompts, batched = normalize_inputs(prompt, input_ids)
        params = per_prompt_params(sampling_params, len(prompts))
        check_logprob_args(return_logprob, top_logprobs_num, logprob_start_len)
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        eos = self.loaded.config.eos_token_ids
        reqs: list[Req] = []
        for p, sp, r in zip(prompts, params, rids):
            ids, text = tokenize(self.tokenizer, p)
            prepared = PreparedInput(ids, text, sp)
            r = r if r is not None else f"engine-{next(self._ids)}"
            reqs += expand(prepared, rid=r, eos_ids=eos, rng=self._rng, return_logprob=return_logprob,
                           top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len, stream=stream)
        for r in reqs:  # all or nothing: a bad request in a batch enqueues none of it
            self.scheduler.validate(r)
        return reqs, batched

    def _stream(self, reqs: list[Req]) -> Iterator[dict]:
        yield from self._drive(reqs)

    def _drive(self, reqs: list[Req]) -> Iterator[dict]:
        """Step the scheduler until these requests finish, yielding each progress update."""
        start = time.perf_counter()
        state = {}
        for r in reqs:
            p = r.sampling_params
            self.detokenizer.register(r.rid, skip_special_tokens=p.skip_special_tokens,
                                      spaces_between_special_tokens=p.spaces_between_special_tokens,
                                      stop=p.stop, no_stop_trim=p.no_stop_trim)
            self.scheduler.add(r)
            state[r.rid] = {"ids": [], "logprobs": {}}
        pending = set(state)
        try:
            while pending:
                outputs = self.scheduler.step()
                if not outputs and not self.scheduler.has_work():
                    raise RuntimeError("scheduler went idle with requests pending")
                for d in self.detokenizer.process(outputs):
                    if d.rid not in state:
                        continue
                    s = state[d.rid]
                    out = d.out
                    s["ids"] += out.new_ids
                    _merge_logprobs(s["logprobs"], out)
                    if out.finished_reason is not None:
                        pending.discard(d.rid)
                    yield {"text": d.text, "output_ids": list(s["ids"]),
                           "meta_info": {"id": d.rid, "finish_reason": out.finished_reason,
                                         "prompt_tokens": out.prompt_tokens,
                                         "completion_tokens": out.completion_tokens,
                                         "cached_tokens": out.cached_tokens,
                                         "e2e_latency": time.perf_counter() - start, **s["logprobs"]}}
        finally:
            for rid in pending:  # the caller stopped early or a step failed: free what they held
                self.scheduler.abort(rid, notify=False)
                self.detokenizer.discard(rid)

    # --- management ----------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_stats(self) -> dict:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Nothing runs in the background; kept for API parity with SGLang's Engine."""

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
