"""Tensor parallelism on CPU: real processes in a gloo group, each holding its shard of a tiny random checkpoint
(fp32), against the same checkpoint unsharded. Column-parallel qkv and gate_up, row-parallel o and down with
an all-reduce each, a vocab-parallel embedding and LM head (logits gathered), KV heads split or replicated.
More than two ranks: the layout's arithmetic at tp 4 in test_layout_and_refusals; four processes reducing
together in tests/kernels/test_allreduce_norm.py."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import radixlm
from radixlm.srt.distributed.parallel import TensorParallel
from tests.helpers import make_tiny_checkpoint, rel_err
from tests.srt.tp_worker import run_rank

IDS = [1, 504, 357, 282, 464, 314, 742, 30, 198, 178, 314, 260, 357, 282, 996, 47, 2, 17]
BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, initializer_range=0.05, vocab_size=1001)


def _run(paths, size: int, tmp_path, quantization: str | list = "none") -> list[dict]:
    tag = quantization if isinstance(quantization, str) else "-".join(quantization)
    out = tmp_path / f"tp{size}{tag}.pt"
    init = f"file://{tmp_path / f'rendezvous{size}{tag}'}"
    args = (size, init, [str(p) for p in paths], IDS, str(out), quantization)
    if size == 1:
        run_rank(0, *args)
    else:
        mp.start_processes(run_rank, args=args, nprocs=size, start_method="spawn")
    return torch.load(out)


# (architecture, extra config); every one at tp 2 in one group of processes
MODELS = [
    ("llama", dict(num_key_value_heads=2)),
    ("qwen2", dict(num_key_value_heads=2, tie=True)),  # qkv bias; the head is the embedding's shard
    ("qwen3", dict(num_key_value_heads=2, head_dim=16)),  # per-head q/k norm
    ("llama", dict(num_key_value_heads=1)),  # fewer KV heads than ranks: its one KV head replicated on both
]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Every model of MODELS at tp 1 and, in one group of processes, at tp 2; in that same tp-2 group the first
    model once more with an e4m3 KV pool, and the FP8 checkpoints of test_fp8_checkpoints_and_online_fp8_shard
    (one spawn of two ranks for all of it)."""
    from tests.srt.test_fp8 import SIZES, _to_fp8_checkpoint

    tmp_path = tmp_path_factory.mktemp("sharded")
    paths = []
    for i, (arch, extra) in enumerate(MODELS):
        extra = dict(extra)
        tie = extra.pop("tie", False)
        paths.append(make_tiny_checkpoint(tmp_path / f"{arch}{i}", arch, tie=tie, **BASE, **extra))
    src = make_tiny_checkpoint(tmp_path / "bf16", "llama", **{**SIZES, "vocab_size": BASE["vocab_size"]})
    fp8s = [_to_fp8_checkpoint(src, tmp_path / m, m) for m in ("compressed-tensors", "fp8")]
    fp8_group = [*fp8s, src, *fp8s]
    fp8_methods = ["none", "none", "fp8", "fp8", "fp8"]
    one = _run(paths, 1, tmp_path)
    two = _run([*paths, paths[0], *fp8_group], 2, tmp_path, ["none"] * len(paths) + ["kv8"] + fp8_methods)
    kv8_one = _run(paths[:1], 1, tmp_path, quantization="kv8")[0]
    n = len(paths)
    return {
        "one": one,
        2: two[:n],
        "kv8": (kv8_one, two[n]),
        "fp8": {"src": src, "checkpoints": fp8s, 2: two[n + 1 :]},
    }


def test_sharded_logits_match_one_rank(sharded):
    one, size = sharded["one"], 2
    for (arch, extra), a, b in zip(MODELS, sharded[size], one):
        assert a["heads"] == (4 // size, max(1, extra["num_key_value_heads"] // size)), arch
        for key in ("whole", "split", "decode"):
            assert a[key].shape == b[key].shape and b[key].shape[-1] == BASE["vocab_size"]
            assert rel_err(a[key], b[key]) < 1e-5, (arch, key)
            assert torch.equal(a[key].argmax(-1), b[key].argmax(-1)), (arch, key)


def test_e4m3_kv_pool_at_tp2(sharded):
    """An e4m3 KV pool at tp 2: every rank runs the calibration forward (its all-reduces with the others'), and
    calibrates its layers' scales on its own KV heads, so rank 0's scales are at most one rank's (over every
    head). Logits that read the pool (a prefix from it, a decode step over it) stay within e4m3's error of the
    same model with a float32 pool, at tp 2 as at tp 1."""
    ref = sharded["one"][0]
    one, two = sharded["kv8"]
    assert ref["kv_scales"] is None and one["kv_scales"] is not None
    for mine, whole in zip(two["kv_scales"], one["kv_scales"]):  # K, then V: a scale per layer
        assert len(mine) == len(whole) == 2 and all(0 < a <= b * (1 + 1e-6) for a, b in zip(mine, whole))
    for key in ("split", "decode"):
        assert 1e-4 < rel_err(one[key], ref[key]) < 0.06, key  # the pool's e4m3 rounding is there, and small
        assert rel_err(two[key], ref[key]) < 0.06, key
    assert rel_err(two["whole"], ref["whole"]) < 0.06


def test_layout_and_refusals():
    tp = TensorParallel(size=4, rank=3)
    assert tp.kv_heads(8) == (2, 6) and tp.kv_heads(2) == (1, 1) and tp.kv_heads(1) == (1, 0)
    assert tp.vocab_range(1001) == (753, 251, 248)
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        TensorParallel(size=2).even(9, "attention heads")
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        TensorParallel(size=4).kv_heads(3)


def test_engine_with_two_ranks_answers_as_one_and_checks_its_batches(tmp_path):
    """One scheduler deciding for two ranks, overlap scheduling forced (the CUDA default): each decode step's
    input ids are the previous step's sampled ids on the device, which rank 0 broadcasts to the other rank's
    futures. Greedy and seeded sampled answers equal one rank's, twice over (the second time from the radix
    cache). With --tp-check-batches every rank digests the step it is about to run (the batch and its own
    request-table entries for it): a consistent run passes; a slot number changed on rank 0 alone,
    mid-generation, is an error naming the ranks before any rank computes with it."""
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
    two = radixlm.Engine(str(path), tp_size=2, tp_check_batches=True, **kw)
    try:
        assert two.scheduler.overlap and two.runner.model.tp.size == 2
        for _ in range(2):
            assert [o["output_ids"] for o in two.generate(input_ids=prompts, sampling_params=sp)] == want
        stream = two.generate(input_ids=[4, 5, 6, 7], sampling_params=sp[0], stream=True)
        next(stream)
        row = two.scheduler.running[0].req_pool_idx
        pool = two.runner.req_to_token_pool
        journal, pool.journal = pool.journal, None  # a write the other rank never hears of
        pool.write(row, 0, pool.host[row, 1:2].clone())
        pool.journal = journal
        with pytest.raises(RuntimeError, match=r"disagree on the batch .*ranks \[1\]"):
            for _ in stream:
                pass
    finally:
        two.shutdown()


def test_fp8_checkpoints_and_online_fp8_shard(sharded, tmp_path):
    """The FP8 checkpoint formats users download, each rank reading its part (per-channel weights sliced with their
    scales; block-scaled ones folded, then sliced): dequantized (where FP8 does not run) at tp 2 they are exactly
    the one-rank model. Run in FP8 at tp 2, online from bf16 weights too, the logits stay within e4m3's error of
    the fp32 model's (a row-parallel shard's scales and each rank's activation scales are over its own columns,
    so not bit-equal to one rank's). The tp-2 run is the `sharded` fixture's group: [*fp8s, src, *fp8s], the
    first two dequantized, the last three in FP8."""
    fp8 = sharded["fp8"]
    ref = _run([fp8["src"]], 1, tmp_path)[0]["whole"]
    one = _run(fp8["checkpoints"], 1, tmp_path)
    two = fp8[2]
    assert len(two) == 5
    for a, b in zip(two, one):
        assert rel_err(a["whole"], b["whole"]) < 1e-5 and rel_err(a["decode"], b["decode"]) < 1e-5
        assert 0.001 < rel_err(b["whole"], ref) < 0.05  # the checkpoints' e4m3 rounding is there
    for got in two[2:]:
        assert 0.01 < rel_err(got["whole"], ref) < 0.06
        assert rel_err(got["split"], got["whole"]) < 1e-4
