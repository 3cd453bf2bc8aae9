"""Tensor parallelism on CPU: real processes in a gloo group, each holding its shard of a tiny random checkpoint
(fp32), against the same checkpoint unsharded. Column-parallel qkv and gate_up, row-parallel o and down with
an all-reduce each, a vocab-parallel embedding and LM head (logits gathered), KV heads split or replicated."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import radixlm
from radixlm.srt.distributed.parallel import TensorParallel
from tests.helpers import make_tiny_checkpoint
from tests.srt.tp_worker import run_rank

IDS = [1, 504, 357, 282, 464, 314, 742, 30, 198, 178, 314, 260, 357, 282, 996, 47, 2, 17]
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, initializer_range=0.05, vocab_size=1001)


def _run(path, size: int, tmp_path) -> dict:
    out = tmp_path / f"tp{size}.pt"
    init = f"file://{tmp_path / f'rendezvous{size}'}"
    if size == 1:
        run_rank(0, 1, init, str(path), IDS, str(out))
    else:
        mp.start_processes(run_rank, args=(size, init, str(path), IDS, str(out)), nprocs=size, start_method="spawn")
    return torch.load(out)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "arch,size,extra",
    [
        ("llama", 2, dict(num_key_value_heads=2)),
        ("llama", 4, dict(num_key_value_heads=2)),  # 2 KV heads on 4 ranks: each replicated twice
        ("qwen2", 2, dict(num_key_value_heads=2, tie_word_embeddings=True)),  # qkv bias; the head is the embedding
        ("qwen3", 2, dict(num_key_value_heads=2, head_dim=16)),  # per-head q/k norm
    ],
)
def test_sharded_logits_match_one_rank(arch, size, extra, tmp_path):
    tie = extra.pop("tie_word_embeddings", False)
    path = make_tiny_checkpoint(tmp_path / arch, arch, tie=tie, **BASE, **extra)
    one = _run(path, 1, tmp_path)
    many = _run(path, size, tmp_path)
    kv = extra["num_key_value_heads"]
    assert many["heads"] == (4 // size, max(1, kv // size))
    for key in ("whole", "split", "decode"):
        assert many[key].shape == one[key].shape and one[key].shape[-1] == BASE["vocab_size"]
        assert _rel(many[key], one[key]) < 1e-5, key
        assert torch.equal(many[key].argmax(-1), one[key].argmax(-1))


def test_layout_and_refusals():
    tp = TensorParallel(size=4, rank=3)
    assert tp.kv_heads(8) == (2, 6) and tp.kv_heads(2) == (1, 1) and tp.kv_heads(1) == (1, 0)
    assert tp.vocab_range(1001) == (753, 251, 248)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        TensorParallel(size=2).even(9, "attention heads")
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        TensorParallel(size=4).kv_heads(3)


def test_engine_with_two_ranks_and_overlap_answers_as_one(tmp_path):
    """One scheduler deciding for two ranks, overlap scheduling forced (the CUDA default): each decode step's
    input ids are the previous step's sampled ids on the device, which rank 0 broadcasts to the other rank's
    futures. Greedy and seeded sampled answers equal one rank's, twice over (the second time from the radix
    cache)."""
    path = make_tiny_checkpoint(tmp_path / "llama", "llama", num_key_value_heads=2, **BASE)
    prompts = [[1, 5, 7, 9, 11], [3, 4, 5], [100, 200, 300, 400, 500, 600]]
    sp = [
        {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
        {"temperature": 0.8, "seed": 3, "max_new_tokens": 16, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True},
    ]
    kw = dict(log_level="warning", max_total_tokens=1024, dtype="float32", force_overlap_schedule=True)
    one = radixlm.Engine(str(path), **kw)
    want = [o["output_ids"] for o in one.generate(input_ids=prompts, sampling_params=sp)]
    one.shutdown()
    two = radixlm.Engine(str(path), tp_size=2, **kw)
    try:
        assert two.scheduler.overlap and two.runner.model.tp.size == 2
        for _ in range(2):
            assert [o["output_ids"] for o in two.generate(input_ids=prompts, sampling_params=sp)] == want
    finally:
        two.shutdown()


def test_check_batches_catches_a_rank_local_difference(tmp_path):
    """--tp-check-batches: every rank digests the step it is about to run (the batch and its own request-table
    entries for it). A consistent run passes; a slot number changed on rank 0 alone, mid-generation, is an
    error naming the ranks before any rank computes with it."""
    path = make_tiny_checkpoint(tmp_path / "llama", "llama", num_key_value_heads=2, **BASE)
    eng = radixlm.Engine(
        str(path), tp_size=2, tp_check_batches=True, log_level="warning", max_total_tokens=1024, dtype="float32"
    )
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    try:
        assert len(eng.generate(input_ids=[1, 2, 3], sampling_params=sp)["output_ids"]) == 8
        stream = eng.generate(input_ids=[4, 5, 6, 7], sampling_params=sp, stream=True)
        next(stream)
        row = eng.scheduler.running[0].req_pool_idx
        pool = eng.runner.req_to_token_pool
        journal, pool.journal = pool.journal, None  # a write the other rank never hears of
        pool.write(row, 0, pool.host[row, 1:2].clone())
        pool.journal = journal
        with pytest.raises(RuntimeError, match=r"disagree on the batch .*ranks \[1\]"):
            for _ in stream:
                pass
    finally:
        eng.shutdown()
