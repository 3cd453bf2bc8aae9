"""Where a serving decode step spends its time: the in-process Engine (scheduler + runner + sampler) vs the
runner alone, on the Llama-3.1-8B-shaped model with random weights; cProfile of the slowest case.

    python benchmarks/gpu/profile_engine.py TOKENIZER_DIR OUT_DIR
"""
from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time

import radixlm

tok, out = sys.argv[1], sys.argv[2]
eng = radixlm.Engine(model_path="benchmarks/configs/llama-3.1-8b", load_format="dummy", tokenizer_path=tok)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(32)]


def timed(bs: int, new: int, bias: bool) -> float:
    eng.flush_cache()
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    if bias:
        params["logit_bias"] = {128001: -100}
    t = time.perf_counter()
    eng.generate(input_ids=prompts[:bs], sampling_params=params)
    return time.perf_counter() - t


timed(1, 4, True)
timed(32, 4, True)
rows = []
for bs in (1, 32):
    for bias in (False, True):
        prefill = timed(bs, 1, bias)
        total = timed(bs, 129, bias)
        rows.append(f"bs {bs:>2} logit_bias {bias!s:>5}: prefill {prefill * 1e3:7.1f} ms, "
                    f"decode {(total - prefill) / 128 * 1e3:6.2f} ms/step")
for bs in (1, 32):
    prof = cProfile.Profile()
    prof.enable()
    timed(bs, 65, True)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    open(f"{out}/profile_bs{bs}.txt", "w").write(s.getvalue())
print("\n".join(rows))
