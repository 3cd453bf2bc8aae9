"""GGUF checkpoints: metadata -> ModelConfig, tensors dequantized (gguf package) to HF names and layout."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from radixlm.srt.errors import ModelLoadError
from radixlm.srt.model_loader.default_model import cache_dir
from radixlm.srt.model_loader.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from radixlm.srt.layers.quantization.gguf_int4 import Q4Blocks
    from radixlm.srt.layers.quantization.gguf_q8 import Q8Rows

logger = logging.getLogger(__name__)

_ARCHES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _reader_class():
    import gguf  # noqa: PLC0415 - only GGUF users pay for the import

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader parses metadata through tens of thousands of tiny slices of its np.memmap; each memmap
        slice pays for subclass bookkeeping. A plain ndarray view of the same mapping parses ~3x faster."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return gguf, PlainArrayReader


@dataclass
class GGUFTensor:
    """What we read of one tensor (the attributes of gguf's ReaderTensor that we use)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data: np.ndarray  # a view of the file's mapping: raw blocks (uint8) for quantized types


_ARRAY_FIELDS_KEPT = 64  # longer array fields (the vocabulary, the merges) are kept as their length only


def _read_header(path: Path, gguf, reader_cls) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata fields, tensors) of a GGUF file. gguf's reader parses every metadata field in Python, the
    ~100k strings of the vocabulary and merges included (~1 s of a ~2 s load for the embedded model), which
    we never read (the tokenizer comes from its own cached directory). So the first read of a file keeps what
    we use as JSON in the cache, keyed by the file's path, size and mtime, and later loads map the tensors
    straight from their recorded offsets."""
    from importlib.metadata import version  # noqa: PLC0415

    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{version('gguf')}".encode()).hexdigest()
    cached = cache_dir() / "gguf-headers" / f"{key[:16]}.json"
    if cached.is_file():
        head = json.loads(cached.read_text())
        mm = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
        tensors = [
            GGUFTensor(
                name,
                gguf.GGMLQuantizationType(kind),
                tuple(shape),
                mm[offset : offset + nbytes].view(np.dtype(dtype)).reshape(rows),
            )
            for name, kind, shape, offset, nbytes, dtype, rows in head["tensors"]
        ]
        return head["fields"], tensors
    reader = reader_cls(path)
    fields: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if len(field.data) <= _ARRAY_FIELDS_KEPT or field.types[0] != gguf.GGUFValueType.ARRAY:
            fields[name] = field.contents()
        fields[f"{name}.__len__"] = len(field.data)
    tensors = [GGUFTensor(t.name, t.tensor_type, tuple(int(v) for v in t.shape), t.data) for t in reader.tensors]
    if reader.byte_order == "I":  # a file in our byte order: its tensors can be mapped as they are
        rows = [
            [
                t.name,
                int(t.tensor_type),
                [int(v) for v in t.shape],
                int(t.data_offset),
                int(t.data.nbytes),
                t.data.dtype.str,
                list(t.data.shape),
            ]
            for t in reader.tensors
        ]
        tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"fields": fields, "tensors": rows}))
            os.replace(tmp, cached)
        except (OSError, TypeError, ValueError) as e:  # a read-only cache or an odd field: just parse next time
            logger.info("GGUF header not cached (%s)", e)
            tmp.unlink(missing_ok=True)
    return fields, tensors


class GGUFCheckpoint:
    def __init__(self, path: str | os.PathLike):
        gguf, reader_cls = _reader_class()
        self.path = Path(path)
        try:
            self.fields, self.tensors = _read_header(self.path, gguf, reader_cls)
        except Exception as e:  # the gguf package raises bare ValueErrors for bad files
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}", param="model_path") from e
        self.gguf = gguf
        arch = self._field("general.architecture")
        if arch not in _ARCHES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHES)}", param="model_path"
            )
        self.arch = arch
        names = {t.name for t in self.tensors}
        if "rope_freqs.weight" in names:
            raise ModelLoadError(
                "GGUF files with rope_freqs (Llama-3 rope scaling) are not supported yet; "
                "load the HF checkpoint instead",
                param="model_path",
            )
        self.config = self._build_config(names)

    def _field(self, key: str, default=None):
        return self.fields.get(key, default)

    def _build_config(self, names: set[str]) -> ModelConfig:
        a = self.arch
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        head_dim = self._field(f"{a}.attention.key_length") or hidden // heads
        vocab = self._field(f"{a}.vocab_size") or self.fields["tokenizer.ggml.tokens.__len__"]
        scaling_type = self._field(f"{a}.rope.scaling.type")
        scaling = None
        if scaling_type and scaling_type != "none":
            scaling = {
                "rope_type": scaling_type,
                "factor": self._field(f"{a}.rope.scaling.factor"),
                "original_max_position_embeddings": self._field(f"{a}.rope.scaling.original_context_length"),
            }
        eos = self._field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=_ARCHES[a],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._field(f"{a}.feed_forward_length"),
            num_layers=self._field(f"{a}.block_count"),
            num_heads=heads,
            num_kv_heads=self._field(f"{a}.attention.head_count_kv") or heads,
            head_dim=head_dim,
            rms_norm_eps=self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            context_length=self._field(f"{a}.context_length", 2048),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias=a == "qwen2",
            qk_norm=a == "qwen3",
            eos_token_ids=[eos] if eos is not None else [],
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
        )

    def weights(
        self, dtype: torch.dtype, skip: frozenset[str] = frozenset(), part=None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) pairs, dequantized and cast to `dtype`; HF names in `skip` are left out.
        `part(name)`: the (rows, columns) slices to keep (tensor parallelism), or None for the whole tensor; only
        that part is dequantized (its columns must start and end on quantization blocks)."""
        import torch  # here: opening a checkpoint (resolving a model for the HTTP process) needs no torch

        for t in tqdm(
            self.tensors,
            desc="Loading GGUF weights",
            unit="tensor",
            leave=False,
            disable=not logger.isEnabledFor(logging.INFO),
        ):  # quiet at --log-level warning
            name = _hf_name(t.name)
            if name is None:
                logger.warning("skipping unknown GGUF tensor %s", t.name)
                continue
            if name in skip:
                continue
            data = t.data
            want = part(name) if part is not None else None
            if want is not None:
                data = self._slice_blocks(data, t.tensor_type, want)
            array = self._rows_for_rope(name, self.gguf.dequantize(data, t.tensor_type))
            yield name, torch.from_numpy(np.array(array, copy=not array.flags.writeable)).to(dtype)

    def _slice_blocks(self, data: np.ndarray, kind, want: tuple[slice, ...]) -> np.ndarray:
        """The part `want` ((rows,) or (rows, columns), as Model.rank_rows gives it) of a tensor still in its
        stored form (rows of quantized blocks)."""
        rows, cols = (*want, slice(None))[:2]
        data = data[rows]
        if cols == slice(None):
            return data
        if data.dtype != np.uint8:  # a float tensor: its columns are elements
            return data[:, cols]
        block, size = self.gguf.GGML_QUANT_SIZES[kind]
        if cols.start % block or cols.stop % block:
            raise ModelLoadError(
                f"a tensor-parallel column range [{cols.start}, {cols.stop}) splits this GGUF's quantization "
                f"blocks of {block}: choose a tp_size that keeps each rank's columns whole blocks",
                param="tp_size",
            )
        return data[:, cols.start // block * size : cols.stop // block * size]

    def has_q4_weights(self) -> bool:
        """Whether any 2-D linear weight is Q4_0/Q4_1 (what --quantization gguf keeps packed)."""
        q4 = (self.gguf.GGMLQuantizationType.Q4_0, self.gguf.GGMLQuantizationType.Q4_1)
        return any(t.tensor_type in q4 and len(t.shape) == 2 and _hf_name(t.name) is not None for t in self.tensors)

    def q4_weights(self) -> Iterator[tuple[str, "Q4Blocks"]]:
        """Yield (HF name, blocks) for the 2-D Q4_0/Q4_1 tensors, still quantized, rows in our layout."""
        from radixlm.srt.layers.quantization.gguf_int4 import Q4Blocks  # noqa: PLC0415

        q4 = {self.gguf.GGMLQuantizationType.Q4_0: "Q4_0", self.gguf.GGMLQuantizationType.Q4_1: "Q4_1"}
        for t in self.tensors:
            name = _hf_name(t.name)
            kind = q4.get(t.tensor_type)
            if name is None or kind is None or len(t.shape) != 2:
                continue
            k, n = (int(v) for v in t.shape)  # GGUF lists dimensions innermost first
            blocks = Q4Blocks.from_gguf(t.data, kind, n, k)
            yield name, blocks.map_rows(lambda a: self._rows_for_rope(name, a))

    def q8_embedding(self) -> "Q8Rows | None":
        """token_embd still quantized when it is Q8_0 (it is in the embedded SmolLM2), else None."""
        from radixlm.srt.layers.quantization.gguf_q8 import Q8Rows  # noqa: PLC0415

        t = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        if t is None or t.tensor_type != self.gguf.GGMLQuantizationType.Q8_0:
            return None
        k, n = (int(v) for v in t.shape)
        return Q8Rows.from_gguf(t.data, n, k)

    def _rows_for_rope(self, name: str, rows: np.ndarray) -> np.ndarray:
        """llama.cpp's converter interleaves the rotary halves of Q/K rows; undo it for rotate-half rope.
        Works on any array whose first axis is the weight's rows (dequantized weights or block parts)."""
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            cfg = self.config
            return _unpermute(rows, rows.shape[0] // cfg.head_dim)  # whole heads (all, or a rank's)
        return rows

    def load_tokenizer(self):
        from transformers import AutoTokenizer  # noqa: PLC0415

        return AutoTokenizer.from_pretrained(self.tokenizer_dir())

    def tokenizer_dir(self) -> Path:
        """transformers builds a tokenizer from GGUF metadata slowly (~10 s), so we convert once and keep the
        result as an ordinary tokenizer directory in the cache."""
        st = self.path.stat()
        key = hashlib.sha1(f"{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        target = cache_dir() / "tokenizers" / key
        if (target / "tokenizer_config.json").is_file():
            return target
        from transformers import AutoTokenizer  # noqa: PLC0415 - only to convert (it imports torch)

        tok = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        tmp = target.with_name(f"{key}.tmp{os.getpid()}")
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
        return target


def _hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    base, _, kind = gguf_name.rpartition(".")
    hf = _GLOBAL_NAMES.get(base)
    return f"{hf}.{kind}" if hf else None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
