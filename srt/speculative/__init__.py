"""Speculative decoding without a draft model: n-gram / prompt-lookup drafts (ngram.py), chosen per step by the
scheduler's drafter (drafter.py) and verified in one extend forward (scheduler/batch.py build_verify,
scheduler/output.py)."""
