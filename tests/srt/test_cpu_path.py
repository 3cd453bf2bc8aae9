"""The flat CPU layer loop (srt/models/llama_cpu.py) against the module path it replaces, and our Q8_0 head
kernel (srt/layers/quantization/q8_gemm.c) against fp64 on the dequantized weights."""

import pytest
import torch

import radixlm
from radixlm.kernels import cpu as cpu_ext
from radixlm.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from tests.helpers import forward_logits, make_tiny_checkpoint, rel_err
from tests.srt.test_model_correctness import PROMPT_IDS


def _module_path(engine):
    """Context: the engine's model runs its nn.Module layers (the reference) instead of the CPU loop."""

    class _Ctx:
        def __enter__(self):
            self.model = engine.runner.model.model
            self.path, self.model.cpu_path = self.model.cpu_path, None

        def __exit__(self, *exc):
            self.model.cpu_path = self.path

    return _Ctx()


def _decode_logits(engine, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt but its last token as an extend, then one decode step of the whole (ragged) batch."""
    r = engine.runner
    rows = [r.req_to_token_pool.alloc() for _ in prompts]
    slots = [r.token_to_kv_pool.alloc(len(p)) for p in prompts]
    try:
        for row, s, p in zip(rows, slots, prompts):
            r.req_to_token_pool.write(row, 0, s)
            n = len(p) - 1
            r.forward(
                ForwardBatch.build(
                    ForwardMode.EXTEND,
                    r.device,
                    input_ids=p[:n],
                    positions=list(range(n)),
                    req_pool_indices=[row],
                    seq_lens=[n],
                    out_cache_loc=s[:n],
                    logits_indices=[n - 1],
                    extend_prefix_lens=[0],
                    extend_seq_lens=[n],
                )
            )
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            r.device,
            input_ids=[p[-1] for p in prompts],
            positions=[len(p) - 1 for p in prompts],
            req_pool_indices=rows,
            seq_lens=[len(p) for p in prompts],
            out_cache_loc=torch.stack([s[-1] for s in slots]),
        )
        return r.forward(fb)
    finally:
        for row, s in zip(rows, slots):
            r.token_to_kv_pool.free(s)
            r.req_to_token_pool.free(row)


@pytest.fixture(scope="module")
def cpu_engine(fp32_engine):
    """An fp32 engine on CPU (the suite on a GPU machine loads a CPU one here)."""
    if fp32_engine.runner.device.type == "cpu":
        yield fp32_engine
        return
    engine = radixlm.Engine(log_level="warning", max_total_tokens=4096, device="cpu", quantization="none")
    yield engine
    engine.shutdown()


def test_cpu_loop_matches_module_path_fp32(cpu_engine):
    """Same fp32 math, other op order: extend (one and two pieces) and a ragged decode batch."""
    smol_engine = cpu_engine
    assert smol_engine.runner.model.model.cpu_path is not None
    chat = smol_engine.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [chat, PROMPT_IDS, chat[:7]]
    fast = [
        forward_logits(smol_engine, chat),
        forward_logits(smol_engine, chat, split=9),
        _decode_logits(smol_engine, prompts),
    ]
    with _module_path(smol_engine):
        ref = [
            forward_logits(smol_engine, chat),
            forward_logits(smol_engine, chat, split=9),
            _decode_logits(smol_engine, prompts),
        ]
    for a, b in zip(fast, ref):
        assert rel_err(a, b) < 1e-5
    # the ragged batch's rows are each request's own logits
    alone = torch.cat([_decode_logits(smol_engine, [p]) for p in prompts])
    assert rel_err(fast[2], alone) < 1e-5


def test_cpu_loop_off_for_bf16_models(tmp_path):
    """bf16 activations on CPU keep the module path (its rounding points are the reference's)."""
    d = make_tiny_checkpoint(tmp_path / "m", "llama")
    fp32 = radixlm.Engine(str(d), log_level="warning", max_total_tokens=256, device="cpu")
    assert fp32.runner.model.model.cpu_path is not None
    bf16 = radixlm.Engine(str(d), log_level="warning", max_total_tokens=256, dtype="bfloat16", device="cpu")
    assert bf16.runner.model.model.cpu_path is None


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 40])
def test_q8_gemm_matches_fp64(m):
    assert cpu_ext.load() is not None  # CI has gcc: the fallback (bf16 hi + lo) is not what ships there
    g = torch.Generator().manual_seed(m)
    n, k = 1000, 96  # n not a multiple of the kernel's 64-row chunks
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = torch.rand(n, k // 32, generator=g).half().float() / 50  # fp16 scales, as in the file
    big = torch.randn(m, k + 5, generator=g)
    x = big[:, 2 : k + 2]  # a row stride other than k
    w = (q.view(n, -1, 32).double() * d.double().unsqueeze(-1)).view(n, k)
    ref = x.double() @ w.T
    y = cpu_ext.q8_gemm(q, d, x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel_err(y.double(), ref) < 1e-6  # fp32 sums of exact products


def test_without_a_c_compiler_torch_ops_serve(cpu_engine, monkeypatch, tmp_path):
    """No C compiler: the CPU loop runs on torch ops, the Q4 linears through torch's int4 op, the tied head as
    bf16 hi + lo GEMMs and decode attention through SDPA; greedy answers still those of the fp32 model."""
    from radixlm.srt.layers.quantization.gguf_int4 import Int4Linear, SplitBf16Linear

    france = cpu_engine.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    cases = [({"input_ids": france}, 24), ({"prompt": "The capital of France is"}, 5)]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for _, n in cases]
    # before the compiler goes: every engine's kernel calls look the library up through the same cache
    want = [cpu_engine.generate(**inputs, sampling_params=p)["output_ids"] for (inputs, _), p in zip(cases, params)]
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_ext.build_variant.cache_clear()
    try:
        engine = radixlm.Engine(log_level="warning", max_total_tokens=1024, quantization="gguf", device="cpu")
        try:
            model = engine.runner.model
            assert model.model.cpu_path is not None and not model.model.cpu_path.kernels
            assert isinstance(model.model.layers[0].mlp.down_proj.quant, Int4Linear)
            assert isinstance(model.lm_head_quant, SplitBf16Linear)
            assert not engine.runner.attn_backend.cpu_decode
            for (inputs, _), p, w in zip(cases, params, want):
                assert engine.generate(**inputs, sampling_params=p)["output_ids"] == w, inputs
        finally:
            engine.shutdown()
    finally:
        monkeypatch.delenv("CC")
        cpu_ext.build_variant.cache_clear()  # the next load() finds the cached library again


@pytest.mark.parametrize("rows", [1, 2, 3, 32, 33])
def test_cpu_linear_equals_f_linear(rows):
    """The torch set's linear computes float32 products of 2..32 rows as (w @ x.T).T: the same numbers as
    F.linear (to float32 rounding), contiguous, bias added; other row counts and dtypes are F.linear itself."""
    from radixlm.srt.layers.ops import cpu_linear

    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g)
    x = torch.randn(rows, 96, generator=g)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for bias in (None, b):
        y = cpu_linear(x, w, bias)
        assert y.shape == (rows, 300) and y.is_contiguous() and y.dtype == torch.float32
        want = ref if bias is not None else ref - b.double()
        assert rel_err(y.double(), want) < 1e-6
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_linear(xb, wb), torch.nn.functional.linear(xb, wb))
