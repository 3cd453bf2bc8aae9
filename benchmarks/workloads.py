"""Prompt sets shared by our benchmarks and the peer runners (benchmarks/peers/), so that both engines get exactly
the same token ids. Standard library only: the peer's Python environment imports it too."""
from __future__ import annotations

import math
import random


def offline_workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    lo, hi = 1000, min(vocab, 40000) - 1  # ordinary tokens, away from special ids at either end
    out = []
    for _ in range(args.num_prompts):
        if args.workload == "random":
            n_in, n_out = args.input_len, args.output_len
        else:
            n_in = int(min(2048, max(4, rng.lognormvariate(math.log(220), 1.1))))
            n_out = int(min(1024, max(4, rng.lognormvariate(math.log(190), 0.9))))
        out.append(([rng.randrange(lo, hi) for _ in range(n_in)], n_out))
    return out
