"""The Llama decoder stack on CPU as one flat loop (decode and extend alike).

A 135M model on a 2-core CPU spends most of a decode step on per-op and per-module overhead, not on
arithmetic: the module path runs ~70 small torch ops and ~10 nn.Module calls per layer (fp32 <-> bf16 round
trips around every int4 matmul, an 8-op RMSNorm, a rope that looks up cos/sin per layer). This loop holds the
layers' tensors directly and runs the same math in far fewer calls:
- with our C kernels (kernels/cpu.py, when a C compiler is there): per layer the four linears (torch's int4
  op, our Q4 GEMM or ops.cpu_linear) and four C calls: residual add + RMSNorm straight to the linear's bf16
  input, rope + KV store from the bf16 qkv output, silu * up in bf16, and the backend's attention (C for decode);
- with torch ops only: torch.rms_norm, the residual added in place (`residual += o`, bf16 o promoted exactly),
  rope on q and k together with cos/sin looked up once per forward: x * cos + roll(x, D/2) * [-sin, sin].
Activations and the residual stay fp32; the int4 linears take bf16 (their op's only fast input) and their
bf16 outputs are promoted where the next step reads them. Attention goes through the batch's backend and
logits through the model's head, so the only thing that branches on the device is whether the runner turns
this path on (`LlamaModel.cpu_path`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels import cpu as cpu_kernels
from radixlm.srt.layers.basic import Linear
from radixlm.srt.layers.ops import cpu_linear
from radixlm.srt.layers.quantization.gguf_int4 import GROUP, Int4Linear, Q4DotLinear
from radixlm.srt.model_executor.forward_batch import ForwardBatch

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu


def _matmul(linear: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ W.T (+ bias) for x already in the linear's input dtype (bf16 for int4, else the weight's)."""
    q, b = linear.quant, linear.bias
    if isinstance(q, Q4DotLinear):
        qs, dm, n, k = q.qs, q.dm, q.out_features, q.in_features
        if b is None:
            return lambda x: cpu_kernels.q4_gemm(qs, dm, x, n, k)
        return lambda x: cpu_kernels.q4_gemm(qs, dm, x, n, k) + b
    if isinstance(q, Int4Linear):
        packed, sz = q.packed, q.scales_zeros
        if b is None:
            return lambda x: _int4_mm(x, packed, GROUP, sz)
        return lambda x: _int4_mm(x, packed, GROUP, sz) + b
    w = linear.weight
    return lambda x: cpu_linear(x, w, b)


def _input_dtype(linear: Linear) -> torch.dtype | None:
    """The dtype this path feeds a linear; None: a form it does not run (the module path is used)."""
    if isinstance(linear.quant, Int4Linear):
        return torch.bfloat16  # the op's only vectorized input dtype
    if isinstance(linear.quant, Q4DotLinear):
        return torch.float32  # our kernel rounds x to bf16 itself
    return linear.weight.dtype if linear.quant is None else None


@dataclass
class _Layer:
    attn: torch.nn.Module  # RadixAttention: the backend call
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Callable
    o: Callable
    gate_up: Callable
    down: Callable


class CpuDecoderPath:
    """Runs LlamaModel's layers and final norm for any batch on CPU; build with `build` (None when the model
    holds something this path does not run)."""

    def __init__(self, model, cfg, layers: list[_Layer], lin_dtype: torch.dtype):
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qk_size = (self.h + self.kvh) * self.d
        self.dim, self.inter, self.eps = (cfg.hidden_size,), cfg.intermediate_size, cfg.rms_norm_eps
        self.layers = layers
        self.embed = model.embed_tokens
        self.final_norm = model.norm.weight
        self.cos_sin = model.layers[0].self_attn.rotary.cos_sin
        self.lin_dtype = lin_dtype
        biases = any(
            lin.bias is not None
            for layer in model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        )
        # The C kernels cover the plain Llama layer (no biases, no q/k norm) with 16-lane head sizes.
        plain = not biases and not cfg.qk_norm and self.d % 16 == 0
        self.kernels = plain and cpu_kernels.load() is not None

    @classmethod
    def build(cls, model, cfg) -> "CpuDecoderPath | None":
        """`model`: the LlamaModel, `cfg` its ModelConfig."""
        dtypes = set()
        layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            dtypes.update(_input_dtype(lin) for lin in linears)
            layers.append(
                _Layer(
                    a.attn,
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    a.q_norm.weight if a.qk_norm else None,
                    a.k_norm.weight if a.qk_norm else None,
                    *(_matmul(lin) for lin in linears),
                )
            )
        norm_dtype = model.norm.weight.dtype
        # One linear input dtype for the whole stack, and fp32 activations (the CPU run dtype): rms_norm's
        # fused kernel then matches the reference's fp32 math.
        if len(dtypes) != 1 or None in dtypes or norm_dtype != torch.float32:
            return None
        return cls(model, cfg, layers, dtypes.pop())

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] cos | cos and -sin | sin for this batch's positions, once per forward."""
        half = self.d // 2
        cs = self.cos_sin.index_select(0, positions)
        cos, sin = cs[:, :half], cs[:, half:]
        return torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([-sin, sin], -1).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.kernels:
            return self._forward_kernels(input_ids, positions, fb)
        return self._forward_torch(input_ids, positions, fb)

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        ck, h, kvh, d, eps, lin_dtype = cpu_kernels, self.h, self.kvh, self.d, self.eps, self.lin_dtype
        bf16 = lin_dtype == torch.bfloat16
        pool, loc, backend = fb.token_to_kv_pool, fb.out_cache_loc, fb.attn_backend
        residual = self.embed(input_ids).contiguous()  # fresh: summed into in place from here on
        add = None  # the previous layer's down projection, added to the residual by the next norm
        for layer in self.layers:
            x = ck.add_rmsnorm(residual, add, layer.in_norm, eps, lin_dtype)
            layer_id = layer.attn.layer_id
            q = ck.rope_store(
                layer.qkv(x), positions, self.cos_sin, pool.k_buffer[layer_id], pool.v_buffer[layer_id], loc, h, kvh, d
            )
            o = layer.o(backend.forward(q, layer.attn, fb).to(lin_dtype))
            x = ck.add_rmsnorm(residual, o, layer.post_norm, eps, lin_dtype)
            gu = layer.gate_up(x)
            if bf16:
                act = ck.silu_mul_bf16(gu)
            else:
                act = F.silu(gu[:, : self.inter]).mul_(gu[:, self.inter :])
            add = layer.down(act)
        return ck.add_rmsnorm(residual, add, self.final_norm, eps, torch.float32)

    def _forward_torch(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = input_ids.shape[0]
        h, kvh, d, eps, dim, inter = self.h, self.kvh, self.d, self.eps, self.dim, self.inter
        qk_size, lin_dtype = self.qk_size, self.lin_dtype
        cos, sin = self._rope_tables(positions)
        pool, loc = fb.token_to_kv_pool, fb.out_cache_loc
        residual = self.embed(input_ids)  # a fresh tensor: summed into in place from here on
        for layer in self.layers:
            x = torch.rms_norm(residual, dim, layer.in_norm, eps)
            qkv = layer.qkv(x.to(lin_dtype)).float()  # .float(): the rope and the KV pool are fp32
            qk = qkv[:, :qk_size].view(t, h + kvh, d)
            if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before the rope
                qk = torch.cat(
                    [
                        torch.rms_norm(qk[:, :h], (d,), layer.q_norm, eps),
                        torch.rms_norm(qk[:, h:], (d,), layer.k_norm, eps),
                    ],
                    1,
                )
            # rotate-half rope: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
            attn = layer.attn
            pool.k_buffer[attn.layer_id].index_copy_(0, loc, qk[:, h:])
            pool.v_buffer[attn.layer_id].index_copy_(0, loc, qkv[:, qk_size:].view(t, kvh, d))
            o = fb.attn_backend.forward(qk[:, :h], attn, fb)
            residual += layer.o(o.to(lin_dtype))
            x = torch.rms_norm(residual, dim, layer.post_norm, eps)
            gu = layer.gate_up(x.to(lin_dtype))
            # silu(gate) * up in fp32, rounded once to the down projection's input dtype (as the module path)
            act = F.silu(gu[:, :inter].float()).mul_(gu[:, inter:])
            residual += layer.down(act.to(lin_dtype))
        return torch.rms_norm(residual, dim, self.final_norm, eps)
