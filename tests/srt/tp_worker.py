"""A tensor-parallel rank for the tests: joins a gloo group, loads its shard of each checkpoint, and computes the
logits of a token sequence three ways (one extend; two extends, the second reading its prefix from the pool; a
decode step after it). Rank 0 saves them. Run by torch.multiprocessing in real processes; size 1 runs in the
calling process, without a group."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def run_rank(
    rank: int, size: int, init: str, paths: list[str], ids: list[int], out: str, quantization: str | list = "none"
) -> None:
    """`quantization`: one for every checkpoint, or one each; "fp8": the linears in e4m3 through torch's CPU
    `_scaled_mm` (the device check lifted in this process, as tests/srt/test_fp8.py does); "kv8": the linears as
    they are and an e4m3 KV pool (each rank calibrates its scales on its own KV heads)."""
    import torch.distributed as dist

    from radixlm.srt.distributed.parallel import SINGLE, init_tensor_parallel
    from radixlm.srt.layers.quantization import fp8
    from radixlm.srt.utils import kill_on_parent_death

    if size > 1:  # a spawned rank (tp 1 runs in the test's process)
        kill_on_parent_death()
    torch.set_num_threads(1)
    methods = [quantization] * len(paths) if isinstance(quantization, str) else list(quantization)
    if "fp8" in methods:
        fp8.fp8_supported = lambda device: None
    tp = init_tensor_parallel(size, rank, init, "gloo", 60) if size > 1 else SINGLE
    try:
        results = [_logits(tp, path, ids, method) for path, method in zip(paths, methods)]
        picked = tp.broadcast_object(f"rank {rank}'s choice")  # as the tuner's picks go out from rank 0
        smallest = tp.all_reduce_min(100 + rank)
        assert picked == "rank 0's choice" and smallest == 100, (picked, smallest)
        if rank == 0:
            torch.save(results, out)
    finally:
        if size > 1:
            dist.destroy_process_group()


def _logits(tp, path: str, ids: list[int], quantization: str) -> dict:
    from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
    from radixlm.srt.model_executor.model_runner import ModelRunner
    from radixlm.srt.model_loader.loader import load_model
    from radixlm.srt.server_args import ServerArgs
    from tests.helpers import forward_logits

    kv8 = quantization == "kv8"
    loaded = load_model(path, dtype="float32", device="cpu", quantization="none" if kv8 else quantization, tp=tp)
    args = ServerArgs(model_path=path, max_total_tokens=512, attention_backend="torch_native",
                      kv_cache_dtype="fp8_e4m3" if kv8 else "auto")  # fmt: skip
    runner = ModelRunner(loaded, args)
    engine = SimpleNamespace(runner=runner)
    whole = forward_logits(engine, ids)
    split = forward_logits(engine, ids, split=len(ids) // 2)
    # a decode step: the last token after the others, attending to them in the pool
    row = runner.req_to_token_pool.alloc()
    slots = runner.token_to_kv_pool.alloc(len(ids))
    runner.req_to_token_pool.write(row, 0, slots)
    n = len(ids) - 1
    prefix = ForwardBatch.build(
        ForwardMode.EXTEND,
        runner.device,
        input_ids=ids[:n],
        positions=list(range(n)),
        req_pool_indices=[row],
        seq_lens=[n],
        out_cache_loc=slots[:n],
        logits_indices=[n - 1],
        extend_prefix_lens=[0],
        extend_seq_lens=[n],
    )
    runner.forward(prefix)
    step = ForwardBatch.build(
        ForwardMode.DECODE,
        runner.device,
        input_ids=ids[n:],
        positions=[n],
        req_pool_indices=[row],
        seq_lens=[n + 1],
        out_cache_loc=slots[n:],
    )
    decode = runner.forward(step)
    heads = (runner.config.num_heads, runner.config.num_kv_heads)
    pool = runner.token_to_kv_pool
    scales = (pool.k_scale, pool.v_scale) if pool.is_fp8 else None
    return {"whole": whole, "split": split, "decode": decode, "heads": heads, "kv_scales": scales}
