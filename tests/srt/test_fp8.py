"""FP8 (e4m3) linears: scales, round trips, the matmul against an fp32 reference, the checkpoint formats users
download, and the whole model in FP8. torch's CPU `_scaled_mm` runs the same W8A8 arithmetic as cuBLASLt (fp32
accumulation, both scales applied to it), so the model path is checked here with the device check lifted; the
server itself refuses FP8 off CUDA (last test)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import radixlm
from radixlm.srt.errors import ModelLoadError
from radixlm.srt.layers.basic import Linear
from radixlm.srt.layers.quantization import fp8 as fp8_mod
from radixlm.srt.layers.quantization.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    Fp8Rows,
    channel_scales,
    dequantize_rows,
    fold_block_scales,
    quantize_rows,
    quantize_tokens,
    scaled_gemm_rows,
)
from tests.helpers import forward_logits, make_tiny_checkpoint, rel_err

E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a rounding moves a value by at most half of this, relatively
SIZES = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02
)
IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198, 1780, 314, 260, 3575, 282, 19628, 47, 2, 17, 9, 300]


# --- scales and round trips ---------------------------------------------------------------------------------
def test_rows_round_trip_within_half_a_step_and_the_largest_value_lands_on_448():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 2, 48)[:, None]  # rows five decades apart
    w[7] = 0.0  # an all-zero row keeps a finite scale and stays zero
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (48,)
    back = dequantize_rows(q, s)
    assert torch.equal(back[7], torch.zeros(96)) and torch.isfinite(s).all()
    big = w.abs() > s[:, None] * 2.0**-6  # e4m3's normal range: subnormals round on an absolute grid
    assert ((back - w).abs() <= w.abs() * E4M3_STEP / 2 + 1e-12)[big].all()
    rows = [i for i in range(48) if i != 7]
    assert torch.equal(q[rows].float().abs().amax(dim=1), torch.full((47,), FP8_MAX))


def test_token_scales_follow_each_token():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1e4])[:, None]
    q, s = quantize_tokens(x)
    assert s.shape == (5, 1) and torch.allclose(s[:, 0], x.abs().amax(dim=1) / FP8_MAX)
    assert rel_err(q.float() * s, x) < E4M3_STEP / 2


def test_scaled_gemm_pads_batches_just_past_a_power_of_two():
    # the lower part of each bucket runs at the bucket's top (see scaled_gemm_rows); small batches, the upper
    # part of a bucket and prompts run as they are
    assert [scaled_gemm_rows(m) for m in (1, 32, 33, 40, 41, 64, 65, 80, 81, 128)] == [1, 32, 64, 64, 41, 64, 128,
                                                                                       128, 81, 128]  # fmt: skip
    assert [scaled_gemm_rows(m) for m in (129, 160, 224, 225, 256, 257, 8192)] == [256, 256, 256, 225, 256, 257, 8192]


@pytest.mark.parametrize("prequant", [False, True])
def test_matmul_padded_rows_give_the_batch_rows_unchanged(prequant):
    g = torch.Generator().manual_seed(3)
    lin = Fp8Linear.from_weight(torch.randn(48, 64, generator=g) * 0.05)
    x = torch.randn(5, 64, generator=g).bfloat16()
    arg = Fp8Rows(*quantize_tokens(x), x.dtype) if prequant else x
    plain, padded = lin.matmul(arg, rows=5), lin.matmul(arg, rows=16)
    assert padded.shape == (5, 48) and padded.dtype == torch.bfloat16
    assert torch.equal(padded, plain)  # rows are independent: zero rows change nothing but the work


def test_matmul_is_the_product_of_the_quantized_operands():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) * 0.05
    x = torch.randn(7, 96, generator=g)
    lin = Fp8Linear.from_weight(w)
    xq, xs = quantize_tokens(x)
    exact = (xq.float() * xs) @ lin.dequantize().T
    y = lin.matmul(x)
    assert y.shape == (7, 64) and y.dtype == torch.float32
    assert rel_err(y, exact) < 1e-6  # both scales applied to the fp32 accumulator, nothing else rounded
    assert rel_err(y, x @ w.T) < 0.05  # e4m3 on both operands: a few percent
    xb = x.bfloat16()
    yb = lin.matmul(xb.reshape(1, 7, 96))
    xq, xs = quantize_tokens(xb)
    exact_b = (xq.float() * xs) @ lin.dequantize().T
    assert yb.shape == (1, 7, 64) and yb.dtype == torch.bfloat16 and rel_err(yb[0], exact_b) < 2.0**-8  # bf16 out


def test_checkpoint_scales_per_channel_or_per_tensor_and_nothing_else():
    assert torch.equal(channel_scales(torch.tensor([[2.0], [3.0]]), 2, "w"), torch.tensor([2.0, 3.0]))
    assert torch.equal(channel_scales(torch.tensor(0.5), 3, "w"), torch.full((3,), 0.5))
    assert torch.equal(channel_scales(torch.tensor([0.5]), 3, "w"), torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj.weight_scale: a weight scale of shape"):
        channel_scales(torch.ones(4, 2), 4, "layers.0.mlp.down_proj.weight_scale")
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear.from_weight(torch.randn(24, 40))


def test_block_scales_fold_into_channel_scales():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 48, generator=g)  # blocks of 16 x 16 that do not divide the rows: a partial last block
    block = (16, 16)
    s_inv = torch.rand(3, 3, generator=g) + 0.1
    full = s_inv.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :48]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    stored = q.float() * full  # the weight the block-scaled checkpoint holds
    q2, s2 = fold_block_scales(q, s_inv, block)
    back = dequantize_rows(q2, s2)
    assert rel_err(back, stored) < E4M3_STEP / 2  # one more rounding, per channel
    with pytest.raises(ValueError, match=r"block scales of shape \(2, 3\)"):
        fold_block_scales(q, s_inv[:2], block)


# --- checkpoints ----------------------------------------------------------------------------------------------
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_fp8_checkpoint(src, dst, method: str, block=(16, 16)):
    """Rewrite a tiny bf16 checkpoint as the FP8 checkpoint format `method` stores it."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if not any(f".{p}." in name for p in _LINEARS):
            out[name] = t
            continue
        if method == "compressed-tensors":
            q, s = quantize_rows(t.float())
            out[name], out[name.replace(".weight", ".weight_scale")] = q, s[:, None].to(torch.bfloat16)
        else:
            n, k = t.shape
            s_inv = torch.empty(-(-n // block[0]), -(-k // block[1]))
            for i in range(s_inv.shape[0]):
                for j in range(s_inv.shape[1]):
                    tile = t[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
                    s_inv[i, j] = tile.abs().max().clamp_min(1e-12) / FP8_MAX
            full = s_inv.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
            out[name] = (t.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            out[name.replace(".weight", ".weight_scale_inv")] = s_inv
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    if method == "compressed-tensors":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "ignore": ["lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                }
            },
        }
    else:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny_checkpoint(root / "bf16", "llama", **SIZES)
    return {
        "bf16": src,
        "compressed-tensors": _to_fp8_checkpoint(src, root / "ct", "compressed-tensors"),
        "fp8": _to_fp8_checkpoint(src, root / "block", "fp8"),
    }


@pytest.fixture
def fp8_anywhere(monkeypatch):
    """Lift the device check: FP8 linears through torch's CPU `_scaled_mm`."""
    monkeypatch.setattr(fp8_mod, "fp8_supported", lambda device: None)


def _engine(path, **kw):
    return radixlm.Engine(str(path), log_level="warning", max_total_tokens=2048, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def reference(tiny):
    e = _engine(tiny["bf16"], quantization="none")
    yield forward_logits(e, IDS), e
    e.shutdown()


@pytest.mark.parametrize("source", ["bf16", "compressed-tensors", "fp8"])
def test_fp8_model_matches_the_unquantized_one(tiny, reference, fp8_anywhere, source):
    """Online from bf16 weights, or from either FP8 checkpoint format: every projection in e4m3 (the head too only
    when asked), logits within e4m3's error of the fp32 model's."""
    ref, _ = reference
    e = _engine(tiny[source], quantization="fp8")
    linears = [m for n, m in e.runner.model.named_modules() if isinstance(m, Linear) and n != "lm_head"]
    assert linears and all(isinstance(m.quant, Fp8Linear) for m in linears)
    assert e.loaded.quantization == "fp8" and e.runner.model.lm_head.quant is None
    assert not any(p.is_meta for p in e.runner.model.parameters())
    got = forward_logits(e, IDS)
    e.shutdown()
    # e4m3 on both operands of every projection: an error of its size (0.04 here), neither more (a scale misread)
    # nor none (the projections not really in FP8)
    assert 0.01 < rel_err(got, ref) < 0.06


def test_fp8_checkpoint_dequantizes_where_fp8_does_not_run(tiny, reference):
    """auto on a CPU: an FP8 checkpoint is dequantized to the run dtype (its scales applied), not read as raw
    e4m3 values, and not refused."""
    ref, _ = reference
    for source in ("compressed-tensors", "fp8"):
        e = _engine(tiny[source])
        assert e.loaded.quantization == "none"
        got = forward_logits(e, IDS)
        e.shutdown()
        assert 0.005 < rel_err(got, ref) < 0.05, source  # the weights' e4m3 rounding only (activations stay fp32)


def test_fp8_head_and_greedy_generation(tiny, reference, fp8_anywhere):
    """--fp8-lm-head puts the untied head in e4m3 too; the model generates what it generates, batch or alone."""
    e = _engine(tiny["bf16"], quantization="fp8", fp8_lm_head=True)
    assert isinstance(e.runner.model.lm_head.quant, Fp8Linear)
    prompts = [IDS, IDS[:5], IDS[3:12]]
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    batch = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=greedy)]
    alone = [e.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts]
    e.shutdown()
    assert batch == alone and all(len(o) == 8 for o in batch)


def test_dummy_weights_load_straight_to_fp8(tiny, fp8_anywhere):
    """Random weights: each projection is created and quantized one at a time (a 70B model's bf16 weights never
    exist whole), the norms and embedding in the run dtype."""
    e = _engine(tiny["bf16"], quantization="fp8", load_format="dummy")
    m = e.runner.model
    assert all(isinstance(layer.mlp.down_proj.quant, Fp8Linear) for layer in m.model.layers)
    assert not any(p.is_meta for p in m.parameters())
    out = e.generate(input_ids=IDS, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
    e.shutdown()
    assert len(out["output_ids"]) == 4


def test_bad_fp8_inputs_are_start_up_errors(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="CUDA GPUs with FP8 tensor cores"):
        _engine(tiny["bf16"], quantization="fp8")  # on a CPU
    with pytest.raises((ValueError, ModelLoadError), match="fp8_lm_head needs --quantization fp8"):
        _engine(tiny["bf16"], fp8_lm_head=True)
    # A scale of the wrong shape names its tensor.
    bad = _to_fp8_checkpoint(tiny["bf16"], tmp_path / "bad", "compressed-tensors")
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(3, 5)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match="down_proj.weight_scale: a weight scale of shape"):
        _engine(bad)
    # A quantization method we do not run.
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization method 'awq' is not supported"):
        _engine(bad)


def test_quantized_rows_reach_the_fp8_projections(tiny, fp8_anywhere):
    """Where the op set has kernels that write e4m3 rows (the Triton set on CUDA), each layer's two norms feed
    qkv and gate_up, and SiLU-and-mul feeds down, rows already quantized per token: the logits are exactly those
    of each projection quantizing its own input, and every such kernel ran (here with the torch references of
    those kernels, which `tests/kernels/test_kernels.py` holds the Triton kernels to)."""
    import dataclasses

    from radixlm.kernels.activation import silu_and_mul_fp8_ref
    from radixlm.kernels.norm import rmsnorm_fp8_ref
    from radixlm.srt.layers.ops import TORCH_OPS, fp8_rows_of
    from radixlm.srt.layers.quantization.fp8 import Fp8Rows

    e = _engine(tiny["bf16"], quantization="fp8")
    model = e.runner.model
    want = forward_logits(e, IDS)
    calls = []
    norm_rows = fp8_rows_of(rmsnorm_fp8_ref)

    def norm(x, residual, weight, eps):
        out = norm_rows(x, residual, weight, eps)
        calls.append(("norm", type(out[0]).__name__))
        return out

    def gate_up_silu(x, q, rows=False):
        y = q.matmul(x)
        calls.append(("silu", rows))
        return Fp8Rows(*silu_and_mul_fp8_ref(y), y.dtype) if rows else TORCH_OPS.fp8_gate_up_silu(x, q)

    model.set_kernel_ops(dataclasses.replace(TORCH_OPS, rmsnorm_fp8=norm, fp8_gate_up_silu=gate_up_silu))
    got = forward_logits(e, IDS)
    e.shutdown()
    layers = len(model.model.layers)
    assert sorted(calls) == sorted([("norm", "Fp8Rows")] * (2 * layers) + [("silu", True)] * layers)
    assert torch.equal(got, want)
