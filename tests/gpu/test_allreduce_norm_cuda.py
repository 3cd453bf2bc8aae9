"""The fused all-reduce + norm kernel on real GPUs (srt/distributed/fused_all_reduce.py): every rank's answer
against the reference computed from every rank's partial rows (gathered by NCCL), the same bits on every rank,
eager calls of every row count the decode buckets use, FP8 rows, and CUDA graphs replayed with new inputs
(the epoch counted on the device across replays). Run on a machine with at least two GPUs:
`python -m pytest -m gpu tests/gpu/test_allreduce_norm_cuda.py`."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from radixlm.srt.distributed.ranks import free_init_addr

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs at least two GPUs")]


def _worker(rank: int, world: int, init: str, errors) -> None:
    try:
        _check(rank, world, init)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
        import traceback

        errors.put(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def _check(rank: int, world: int, init: str) -> None:
    import torch.distributed as dist

    from radixlm.kernels.allreduce_norm import allreduce_rmsnorm_ref
    from radixlm.srt.distributed.fused_all_reduce import setup
    from radixlm.srt.distributed.parallel import init_tensor_parallel

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    tp = init_tensor_parallel(world, rank, init, "nccl", 60)
    fused = setup(tp, dev)
    assert fused is not None, "the fused all-reduce did not set up"

    def same_everywhere(t: torch.Tensor) -> None:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=tp.group)
        assert all(torch.equal(p, parts[0]) for p in parts), "ranks disagree"

    def inputs(rows: int, n: int, seed: int):
        g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
        x = torch.randn(rows, n, generator=g, device=dev).to(torch.bfloat16)
        g.manual_seed(seed)  # the residual stream and the weight are every rank's same tensors
        residual = torch.randn(rows, n, generator=g, device=dev).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, generator=g, device=dev)).to(torch.bfloat16)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=tp.group)
        return x, residual, w, parts

    # eager, every decode-bucket-like row count, both hidden sizes of the Llama shapes, bf16 and FP8 rows
    seed = 0
    for n in (4096, 8192):
        for rows in (1, 2, 7, 16, 32, 64, 96, 160, 256):
            if not fused.takes(torch.empty(rows, n, dtype=torch.bfloat16)):
                continue
            for quant, two_shot in itertools.product((False, True), (False, True) if world >= 4 else (False,)):
                seed += 1
                x, residual, w, parts = inputs(rows, n, seed)
                want = allreduce_rmsnorm_ref(parts, residual.clone(), w, 1e-5, quant=quant)
                got = fused(x, residual, w, 1e-5, quant=quant, two_shot=two_shot)
                torch.cuda.synchronize()
                assert torch.equal(got[-1], want[-1]), f"residual stream differs at {rows} x {n}"
                if quant:
                    assert torch.allclose(got[1], want[1], rtol=1e-2), f"scales differ at {rows} x {n}"
                    deq, ref = got[0].float() * got[1], want[0].float() * want[1]
                    assert ((deq - ref).norm() / ref.norm()).item() < 3e-2
                else:
                    assert ((got[0].float() - want[0].float()).norm() / want[0].float().norm()).item() < 1e-2
                for t in got:
                    same_everywhere(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)

    # ranks out of step: 120 calls back to back with no host sync or collective between them, rank 1 sleeping
    # on its GPU before about half, so that rank 0 runs ahead and its pushes and flags for the next call land
    # while rank 1 still reads the current one (every rank builds every rank's rows itself: no NCCL in between)
    import random

    def local_inputs(rows: int, n: int, seed: int):
        parts = []
        for r in range(world):
            g = torch.Generator(device=dev).manual_seed(seed * 1000 + r)
            parts.append(torch.randn(rows, n, generator=g, device=dev).to(torch.bfloat16))
        g = torch.Generator(device=dev).manual_seed(seed)
        residual = torch.randn(rows, n, generator=g, device=dev).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, generator=g, device=dev)).to(torch.bfloat16)
        return parts, residual, w

    shapes = random.Random(5)  # the same calls on every rank
    # tp 4: one-shot and two-shot calls mixed (two-shot past fused.two_shot_past bytes)
    fits = [r for r in (1, 3, 17, 32, 64, 96) if fused.takes(torch.empty(r, 4096, dtype=torch.bfloat16))]
    plan = [(shapes.choice(fits), shapes.random() < 0.3) for _ in range(120)]
    calls = [local_inputs(rows, 4096, 5000 + i) for i, (rows, _) in enumerate(plan)]
    torch.cuda.synchronize()
    dist.barrier(group=tp.group)
    delays = random.Random(100 + rank)
    outs = []
    for (rows, quant), (parts, residual, w) in zip(plan, calls):
        if rank == 1 and delays.random() < 0.5:
            torch.cuda._sleep(int(delays.random() * 2_000_000))  # up to about a millisecond of GPU clock
        outs.append(fused(parts[rank].clone(), residual.clone(), w, 1e-5, quant=quant))
    torch.cuda.synchronize()
    for i, ((rows, quant), (parts, residual, w), got) in enumerate(zip(plan, calls, outs)):
        want = allreduce_rmsnorm_ref(parts, residual.clone(), w, 1e-5, quant=quant)
        assert torch.equal(got[-1], want[-1]), f"out-of-step call {i} ({rows} rows): residual stream differs"
        same_everywhere(got[-1])

    # CUDA graphs: three calls captured, replayed with new inputs (tp 4: two-shot calls)
    rows, n = (64 if world >= 4 else 32), 4096
    x, residual, w, _ = inputs(rows, n, 99)
    xs = [x.clone() for _ in range(3)]
    res = residual.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for xi in xs:  # warm up (compiles) outside the capture
            fused(xi.clone(), res.clone(), w, 1e-5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused(xi, res, w, 1e-5)[0] for xi in xs]
    for replay in range(5):
        parts_all = []
        for i, xi in enumerate(xs):
            x, _, _, parts = inputs(rows, n, 200 + 10 * replay + i)
            xi.copy_(x)
            parts_all.append(parts)
        start = residual.clone()
        res.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        want_res = start
        for parts in parts_all:
            out, want_res = allreduce_rmsnorm_ref(parts, want_res.clone(), w, 1e-5)
        assert torch.equal(res, want_res), f"graph replay {replay}: residual stream differs"
        assert ((outs[-1].float() - out.float()).norm() / out.float().norm()).item() < 1e-2
        same_everywhere(res)
    dist.barrier(group=tp.group)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [n for n in (2, 4) if n <= GPUS])
def test_fused_all_reduce_norm_matches_the_gathered_reference(world):
    ctx = torch.multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    init = free_init_addr()
    procs = [ctx.Process(target=_worker, args=(r, world, init, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert not alive, "a rank did not finish within 300 s (a wait that never ended)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
