"""Scoring the choices of `select` from token logprobs.

Each choice arrives as the logprobs of its own tokens given the prompt (and, for the unconditional method,
given no prompt); a method returns the index of the choice it picks and the per-choice scores.
"""

from __future__ import annotations

import math
import random

from radixlm.lang.ir import ChoicesMethod


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("-inf")


def pick(
    method: ChoicesMethod, cond: list[list[float]], uncond: list[list[float]] | None = None
) -> tuple[int, list[float]]:
    if method.name == "token_length_normalized":
        scores = [_mean(lps) for lps in cond]
    elif method.name == "unconditional_likelihood_normalized":
        if uncond is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs")
        # how much the prompt raises each choice's likelihood, per token: favours answers the context
        # supports over answers that are merely common
        # (the unconditional first token has no context and no logprob: it counts as 0, as in SGLang)
        scores = [_mean(c) - sum(u) / max(len(c), 1) for c, u in zip(cond, uncond)]
    elif method.name == "greedy_token_selection":
        return _greedy(cond), [_mean(lps) for lps in cond]
    else:
        raise ValueError(f"unknown choices method {method.name!r}")
    return max(range(len(scores)), key=lambda i: scores[i]), scores


def _greedy(cond: list[list[float]]) -> int:
    """Token by token: keep the choices whose token at this position is the likeliest; choices with no token
    left drop out while longer ones remain (the first of the last survivors wins)."""
    alive = list(range(len(cond)))
    pos = 0
    while len(alive) > 1:
        with_token = [i for i in alive if pos < len(cond[i])]
        if not with_token:
            break
        best = max(cond[i][pos] for i in with_token)
        alive = [i for i in with_token if cond[i][pos] == best]
        pos += 1
    return alive[0]


def sample(scores: list[float], temperature: float, rng: random.Random) -> int:
    """A choice drawn in proportion to exp(score / temperature): select(temperature > 0)."""
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return rng.choices(range(len(scores)), weights=weights)[0]


def after_prefix(prefix: list, full: list) -> int:
    """Where a choice's own tokens start in `full` (prefix + choice): at the first token that differs from the
    prefix tokenized alone, since the tokenizer may merge the prefix's last token with the choice's first."""
    k = 0
    while k < len(prefix) and k < len(full) and full[k] == prefix[k]:
        k += 1
    return k
