"""--enable-prefill-overlap: a row-parallel projection of many rows computed and all-reduced in row pieces whose
collectives overlap the next piece's product (srt/layers/parallel.py). Two real processes in a gloo group (gloo
runs an async all-reduce on its own thread, as NCCL runs it on its own stream): the pipelined result must be the
plain one bit for bit (a sum of two ranks' floats does not depend on how the rows are cut), with and without a
bias, for a projection that feeds a norm, and for e4m3 rows with per-token scales (an FP8 down projection's
input), through torch's CPU scaled matmul."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp

ROWS, K, N = 1100, 64, 48  # 1100 rows: two pieces of 512 rows (and a remainder row in the last)


def _worker(rank: int, size: int, init: str, out: str) -> None:
    import dataclasses

    from radixlm.srt.distributed.parallel import PartialSum, init_tensor_parallel
    from radixlm.srt.layers import parallel
    from radixlm.srt.layers.quantization import fp8

    torch.set_num_threads(1)
    fp8.fp8_supported = lambda device: None  # torch's CPU scaled matmul (as tests/srt/test_fp8.py does)
    tp = init_tensor_parallel(size, rank, init, "gloo", 60)
    results = {}
    try:
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(N, K, generator=g) * 0.1
        bias = torch.randn(N, generator=g)
        x = torch.randn(ROWS, K, generator=g)
        shard = slice(rank * K // size, (rank + 1) * K // size)
        for name, has_bias, feeds_norm in (("plain", False, False), ("bias", True, False), ("norm", False, True)):
            layer = parallel.RowParallelLinear(K, N, bias=has_bias, tp=tp, feeds_norm=feeds_norm)
            layer.weight.data = weight[:, shard].contiguous()
            if has_bias:
                layer.bias.data = bias.clone()
            off = layer(x[:, shard])
            off = off.reduced() if isinstance(off, PartialSum) else off
            layer.tp = dataclasses.replace(tp, overlap_rows=1000)
            assert layer._pipelined(x[:, shard]) and not layer._pipelined(x[:999, shard])
            on = layer(x[:, shard])
            assert isinstance(on, torch.Tensor)  # already reduced: the norm takes it as any tensor
            results[name] = (off, on)
        results["whole"] = x @ weight.T
        # e4m3 rows with their scales, as a norm or SiLU kernel hands them to an FP8 projection
        layer = parallel.RowParallelLinear(K, N, tp=tp, feeds_norm=True)
        layer.quant = fp8.Fp8Linear.from_weight(weight[:, shard].contiguous())
        q, scale = fp8.quantize_tokens(x[:, shard])
        rows = fp8.Fp8Rows(q, scale, torch.float32)
        off = layer(rows).reduced()
        layer.tp = dataclasses.replace(tp, overlap_rows=1000)
        results["fp8"] = (off, layer(rows))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    finally:
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(results, f)
        import torch.distributed as dist

        dist.destroy_process_group()


def test_pipelined_row_parallel_projection_equals_the_plain_one(tmp_path):
    out = tmp_path / "results.pkl"
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(_worker, args=(2, init, str(out)), nprocs=2, start_method="spawn")
    results = pickle.loads(out.read_bytes())
    assert "error" not in results, results.get("error")
    for name in ("plain", "bias", "norm", "fp8"):
        off, on = results[name]
        assert on.shape == (ROWS, N) and torch.equal(on, off), name
    whole = results["whole"]
    assert ((results["plain"][1] - whole).norm() / whole.norm()).item() < 1e-5  # the sum over both ranks' halves


def test_rows_split_alike_for_tensors_and_e4m3_rows():
    from radixlm.srt.layers.parallel import row_pieces
    from radixlm.srt.layers.quantization.fp8 import Fp8Rows

    x = torch.arange(10 * 3).view(10, 3)
    assert [p.shape[0] for p in row_pieces(x, 4)] == [3, 3, 3, 1]
    assert torch.equal(torch.cat(row_pieces(x, 4)), x)
    rows = Fp8Rows(torch.zeros(10, 3).to(torch.float8_e4m3fn), torch.arange(10.0).view(10, 1), torch.bfloat16)
    pieces = row_pieces(rows, 3)
    assert [p.q.shape[0] for p in pieces] == [4, 4, 2] and all(p.dtype == torch.bfloat16 for p in pieces)
    assert torch.equal(torch.cat([p.scale for p in pieces]), rows.scale)


@pytest.mark.parametrize("rows", [1, 1023])
def test_small_batches_are_not_pipelined(rows):
    """Decode batches and small extends keep the plain path (the PartialSum a fused norm kernel takes)."""
    from radixlm.srt.distributed.parallel import PartialSum, TensorParallel
    from radixlm.srt.layers.parallel import RowParallelLinear

    layer = RowParallelLinear(8, 4, tp=TensorParallel(size=2, overlap_rows=16), feeds_norm=True)
    assert not layer._pipelined(torch.zeros(rows, 4))  # below two pieces' worth of rows
    layer.weight.data = torch.ones(4, 4)
    assert isinstance(layer.forward(torch.zeros(rows, 4)), PartialSum)
