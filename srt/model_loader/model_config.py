"""The model facts the runtime needs, read from an HF config.json or from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixlm.srt.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# dtype names users and configs write -> torch's name; kept as strings so that reading a config (the HTTP process
# resolving its model) does not import torch
_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "half": "float16",
    "float": "float32",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    context_length: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    checkpoint_dtype: str | None = None  # torch's name of the checkpoint's dtype (parse_dtype gives the dtype)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
                param="model_path",
            )
        try:
            hidden = cfg["hidden_size"]
            heads = cfg["num_attention_heads"]
            # transformers 5 nests rope settings in `rope_parameters`; v4 keeps `rope_theta` + `rope_scaling`.
            rope = dict(cfg.get("rope_parameters") or {})
            theta = rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
            eos = cfg.get("eos_token_id")
            is_qwen2 = arch == "Qwen2ForCausalLM"
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=scaling,
                context_length=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
                o_bias=False if is_qwen2 else bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                checkpoint_dtype=_DTYPES.get(str(dtype_name)) if dtype_name else None,
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
                bos_token_id=cfg.get("bos_token_id"),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}", param="model_path") from e


def parse_dtype(name: str) -> torch.dtype:
    import torch

    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {name!r}") from None
