"""Weights kept quantized in memory (`--quantization`, names as in SGLang).

auto: gguf for a GGUF checkpoint with Q4 linears on a CPU our Q4 kernel runs on (AVX-512 BF16, or AVX2 with
      FMA and F16C), else none.
none: every weight dequantized to the run dtype (the reference path).
fp8:  every projection in e4m3 with per-channel weight scales and per-token activation scales (fp8.py), from a
      bf16 checkpoint or random weights (quantized at load) or an FP8 checkpoint (compressed-tensors, HF fp8);
      CUDA with FP8 tensor cores. auto picks it for an FP8 checkpoint there (elsewhere such a checkpoint is
      dequantized to the run dtype).
gguf: a GGUF checkpoint's Q4_0/Q4_1 linear weights stay 4-bit (gguf_int4.py) and run through our C kernel
      on AVX-512 BF16 or AVX2 (kernels/cpu_kernels.c), else torch's int4 CPU matmul; a Q8_0 embedding keeps its
      8-bit blocks and dequantizes the rows it looks up (gguf_q8.py); a head tied to it runs on those blocks
      through our C kernel, else (no C compiler, or an untied head) as two bf16 GEMMs (hi + lo parts); the
      rest is dequantized.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixlm.kernels import cpu as cpu_kernels
from radixlm.srt.layers.basic import Linear
from radixlm.srt.layers.quantization.gguf_int4 import Int4Linear, Q4Blocks, Q4DotLinear, SplitBf16Linear
from radixlm.srt.layers.quantization.gguf_q8 import Q8Linear

logger = logging.getLogger(__name__)


def load_gguf_quantized(model: nn.Module, ckpt, dtype: torch.dtype) -> None:
    """Fill `model` from a GGUFCheckpoint: Q4 linears packed into `Linear.quant` (their fp32 weight freed),
    the rest through the ordinary dequantizing path."""
    modules = dict(model.named_modules())
    shards: dict[str, dict[int, Q4Blocks]] = {}
    skip: set[str] = set()  # checkpoint names already consumed
    prefilled: set[str] = set()  # our parameter names already filled
    names: dict[str, list[str]] = {}
    packed_bytes = 0
    # Our kernel where the CPU has AVX-512 BF16 or AVX2 (faster than torch's int4 op at every batch size
    # measured), else torch's int4 op.
    q4_class = Q4DotLinear if cpu_kernels.q4_available() else Int4Linear
    for name, blocks in ckpt.q4_weights():
        target, shard, count = model.checkpoint_target(name)
        module_name = target.rpartition(".")[0]
        if not target.endswith(".weight") or not isinstance(modules.get(module_name), Linear):
            continue
        parts = shards.setdefault(target, {})
        parts[shard or 0] = blocks
        names.setdefault(target, []).append(name)
        if len(parts) < count:
            continue  # pack a fused projection once all its shards are here
        linear = modules[module_name]
        fused = Q4Blocks.cat([parts[i] for i in range(count)])
        if tuple(fused.q.shape) != tuple(linear.weight.shape):
            raise ValueError(
                f"GGUF tensor(s) {names[target]} give {tuple(fused.q.shape)}, "
                f"{target} expects {tuple(linear.weight.shape)}"
            )
        linear.quant = q4_class.from_blocks(fused)
        packed_bytes += linear.quant.nbytes()
        # An empty placeholder: the fp32 copy would be most of the process's memory.
        linear.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        del shards[target]
        skip.update(names.pop(target))
        prefilled.add(target)
    table = ckpt.q8_embedding()
    embed = model.model.embed_tokens
    if table is not None:  # exact rows from the 8-bit blocks; never dequantize the whole table
        embed.quant = table
        embed.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        skip.add("model.embed_tokens.weight")
        prefilled.add("model.embed_tokens.weight")
    # Shards of a projection whose other shards are not Q4 (mixed-type files) load dequantized.
    model.load_weights(ckpt.weights(dtype, skip=frozenset(skip)), prefilled=frozenset(prefilled))
    head = getattr(model, "lm_head", None)
    if head is None and table is not None and cpu_kernels.load() is not None:
        model.lm_head_quant = Q8Linear(table)  # tied: the embedding's own blocks, read by our kernel
    elif head is None:  # tied to the embedding
        n, k = model.config.vocab_size, model.config.hidden_size
        rows = table.dequantize if table is not None else (lambda s, e: embed.weight[s:e])
        model.lm_head_quant = SplitBf16Linear.from_rows(rows, n, k)
    elif head.quant is None:
        w = head.weight.detach()
        model.lm_head_quant = SplitBf16Linear.from_rows(lambda s, e: w[s:e], *w.shape)
        head.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)  # no longer read
    logger.info(
        "gguf quantization: %d linears kept in int4 (%s, %.1f MB), embedding %s, output projection %s",
        len(prefilled) - (table is not None),
        f"our {cpu_kernels.q4_isa()} kernel" if q4_class is Q4DotLinear else "torch's int4 op",
        packed_bytes / 1e6,
        "Q8_0 rows" if table is not None else "dequantized",
        "on the embedding's Q8_0 blocks"
        if isinstance(model.lm_head_quant, Q8Linear)
        else f"in bf16 hi + lo ({model.lm_head_quant.nbytes() / 1e6:.1f} MB)"
        if model.lm_head_quant is not None
        else "as its linear",
    )
