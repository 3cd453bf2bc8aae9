"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) on our own layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from radixlm.srt.distributed.parallel import SINGLE, TensorParallel
from radixlm.srt.errors import ModelLoadError
from radixlm.srt.layers.attention.base import RadixAttention
from radixlm.srt.layers.basic import Linear, QuantizedMatmul, RMSNorm
from radixlm.srt.layers.ops import TORCH_OPS, KernelOps
from radixlm.srt.layers.parallel import RowParallelLinear, VocabParallelEmbedding
from radixlm.srt.layers.rotary import RotaryEmbedding
from radixlm.srt.model_executor.forward_batch import ForwardBatch
from radixlm.srt.model_loader.model_config import ModelConfig
from radixlm.srt.models.llama_cpu import CpuDecoderPath


class Attention(nn.Module):
    """`cfg`: this rank's shapes (its heads; LlamaForCausalLM.local_config)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.d, self.kvh * self.d
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        # o and down feed the next norm only: that norm may sum their ranks' shares in its own kernel
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, tp=tp, feeds_norm=True)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.layer_id = layer_id
        self.attn = RadixAttention(layer_id, self.h, self.kvh, self.d, self.d**-0.5)
        self.ops = TORCH_OPS

    def qkv_rope_store(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The projection, q/k norm (Qwen3) and rotary on q and k, k and v into the pool (one kernel where one
        exists); returns the rotated q [T, heads, head_dim]."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(-1, self.h, self.d), k.view(-1, self.kvh, self.d), v.view(-1, self.kvh, self.d)
        pool = fb.token_to_kv_pool
        return self.ops.rope_and_store(
            positions,
            q,
            k,
            v,
            self.rotary.cos_sin,
            pool.k_buffer[self.layer_id],
            pool.v_buffer[self.layer_id],
            fb.out_cache_loc,
            self.q_norm.weight if self.qk_norm else None,
            self.k_norm.weight if self.qk_norm else None,
            self.q_norm.eps if self.qk_norm else 1e-6,
            **pool.scales(self.layer_id),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_rope_store(positions, x, fb), fb))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp, feeds_norm=True
        )
        self.ops = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The activation is fused into the gate_up projection where a kernel does that faster.
        up = self.gate_up_proj
        if getattr(up.quant, "scaled", False) and up.bias is None:  # FP8: the op set's fused path
            # an FP8 down projection may take the activation already quantized per token
            rows = getattr(self.down_proj.quant, "scaled", False)
            return self.down_proj(self.ops.fp8_gate_up_silu(x, up.quant, rows))
        if up.quant is not None:
            return self.down_proj(self.ops.silu_and_mul(up(x)))
        return self.down_proj(self.ops.gate_up_silu(x, up.weight, up.bias))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, fb: ForwardBatch):
        q, residual = self.pre_attention(positions, x, residual, fb)
        return self.post_attention(self.self_attn.attn(q, fb), residual)

    # The two halves around the attention kernel: the graph runner's seam (graph_runner.py cuts forwards here).
    def pre_attention(self, positions, x, residual, fb: ForwardBatch):
        x, residual = self.input_layernorm.before(self.self_attn.qkv_proj, x, residual)
        return self.self_attn.qkv_rope_store(positions, x, fb), residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor):
        x = self.self_attn.o_proj(attn_out)
        x, residual = self.post_attention_layernorm.before(self.mlp.gate_up_proj, x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        # One cos/sin table (float32) shared by every layer.
        rotary = RotaryEmbedding(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The flat CPU loop over the same weights (llama_cpu.py), when the runner turned it on.
        self.cpu_path: CpuDecoderPath | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.cpu_path is not None:
            return self.cpu_path.forward(input_ids, positions, fb)
        x, residual = self.run_layers(self.embed_tokens(input_ids), None, positions, fb)
        x, _ = self.norm(x, residual)
        return x

    def run_layers(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        fb: ForwardBatch,
        start: int = 0,
        stop: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self.layers[start:stop]:
            x, residual = layer(positions, x, residual, fb)
        return x, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = cfg
        self.tp = tp
        kv_heads, self.kv_head_start = tp.kv_heads(cfg.num_kv_heads)
        # This rank's shapes: its query heads, KV heads and MLP columns (the whole model with one rank).
        self.local_config = dataclasses.replace(
            cfg,
            num_heads=tp.even(cfg.num_heads, "attention heads"),
            num_kv_heads=kv_heads,
            intermediate_size=tp.even(cfg.intermediate_size, "MLP columns"),
        )
        self.model = LlamaModel(self.local_config, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, tp.vocab_range(cfg.vocab_size)[1])
        self.ops = TORCH_OPS
        # The output projection in another form than lm_head_weight (quantized loading), when set.
        self.lm_head_quant: QuantizedMatmul | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def enable_cpu_path(self) -> bool:
        """Run the layers through the flat CPU loop (llama_cpu.py) from now on; False when the model holds a
        weight form that loop does not run, or is sharded. Call after loading: the loop holds the loaded tensors."""
        if self.tp.size > 1:
            return False
        self.model.cpu_path = CpuDecoderPath.build(self.model, self.config)
        return self.model.cpu_path is not None

    def set_kernel_ops(self, ops: KernelOps) -> None:
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        if ops.name != "torch":  # the flat CPU loop has its own kernels: another set means the module path
            self.model.cpu_path = None

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits for the rows in `fb.logits_indices` (every row when it is None)."""
        return self.logits(self.model(fb.input_ids, fb.positions, fb), fb)

    def logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if fb.logits_indices is not None:
            hidden = hidden.index_select(0, fb.logits_indices)
        return self.project(hidden)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of every row of `hidden` (final-normed hidden states); sharded, every rank gets all."""
        if self.lm_head_quant is not None:
            local = self.lm_head_quant.matmul(hidden)
        elif not self.config.tie_word_embeddings:
            local = self.lm_head.product(hidden)  # honours lm_head.quant
        else:
            local = self.ops.linear(hidden, self.lm_head_weight, None)
        if self.tp.size == 1:
            return local.float()
        # each rank's vocabulary range, gathered (the last range's padding dropped)
        return self.tp.all_gather_last(local.float())[:, : self.config.vocab_size]

    # --- weights -------------------------------------------------------------------------------------------
    _STACKED = {  # checkpoint name part -> (our fused parameter, shard index)
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    _SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}  # checkpoint tensors per fused parameter

    def _shard_bounds(self, fused: str, shard: int) -> tuple[int, int]:
        cfg = self.local_config
        if fused == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
        n = cfg.intermediate_size
        return (shard * n, (shard + 1) * n)

    def shard_rows(self, target: str, shard: int) -> tuple[int, int]:
        """The rows of fused parameter `target` (e.g. model.layers.0.self_attn.qkv_proj.weight) that its checkpoint
        shard `shard` fills."""
        return self._shard_bounds(target.split(".")[-2], shard)

    def checkpoint_target(self, name: str) -> tuple[str, int | None, int]:
        """Where a checkpoint tensor goes: (our parameter name, shard index or None, shards of that parameter)."""
        for part, (fused, shard) in self._STACKED.items():
            if f".{part}." in name:
                return name.replace(part, fused), shard, self._SHARDS[fused]
        return name, None, 1

    def rank_rows(self, name: str) -> tuple[slice, ...] | None:
        """The part of checkpoint tensor `name` this rank holds under tensor parallelism, as an index: (rows,)
        (a weight's or a bias's) or (all rows, columns); None for a tensor every rank holds whole. The checkpoint
        reader takes just that part (safetensors slices)."""
        if self.tp.size == 1:
            return None
        target, shard, _ = self.checkpoint_target(name)
        tp, local, d, every = self.tp, self.local_config, self.config.head_dim, slice(None)
        param = target.split(".")[-2]
        if param == "qkv_proj":
            if shard == 0:
                n = local.num_heads * d
                return (slice(tp.rank * n, (tp.rank + 1) * n),)
            n = local.num_kv_heads * d
            return (slice(self.kv_head_start * d, self.kv_head_start * d + n),)
        if param == "gate_up_proj":
            n = local.intermediate_size
            return (slice(tp.rank * n, (tp.rank + 1) * n),)
        if param == "o_proj" and target.endswith(".weight"):
            n = local.num_heads * d
            return every, slice(tp.rank * n, (tp.rank + 1) * n)
        if param == "down_proj" and target.endswith(".weight"):
            n = local.intermediate_size
            return every, slice(tp.rank * n, (tp.rank + 1) * n)
        if param in ("embed_tokens", "lm_head"):
            start, _, real = tp.vocab_range(self.config.vocab_size)
            return (slice(start, start + real),)
        return None  # norms and the row-parallel biases

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        prefilled: frozenset[str] = frozenset(),
        sliced: bool = False,
    ) -> None:
        """`prefilled`: parameters the caller already filled some other way (quantized linears). `sliced`: the
        tensors are already this rank's parts (`rank_rows`); else they are whole and cut here."""
        params = dict(self.named_parameters())
        pending = {
            name: next((n for fused, n in self._SHARDS.items() if f".{fused}." in name), 1)
            for name in params
            if name not in prefilled
        }
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard, _ = self.checkpoint_target(name)
            rows = None if shard is None else self._shard_bounds(target.split(".")[-2], shard)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no place in {self.config.architecture}", param="model_path"
                )
            dest = param.data if rows is None else param.data[rows[0] : rows[1]]
            part = self.rank_rows(name)
            if part is not None:
                if not sliced:
                    tensor = tensor[part]
                if target.endswith(("embed_tokens.weight", "lm_head.weight")):
                    dest = dest[: tensor.shape[0]]  # the last vocabulary range's padding rows stay zero
            if dest.shape != tensor.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}",
                    param="model_path",
                )
            dest.copy_(tensor)
            pending[target] -= 1
        missing = sorted(n for n, left in pending.items() if left > 0)
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing weights: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
                param="model_path",
            )


# Every architecture we serve is this one class; the differences live in ModelConfig flags.
MODEL_REGISTRY = {
    arch: LlamaForCausalLM
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
}
