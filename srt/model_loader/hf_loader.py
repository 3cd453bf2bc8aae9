"""Local Hugging Face checkpoints: config.json + one or many *.safetensors (with or without an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from radixlm.srt.errors import ModelLoadError
from radixlm.srt.model_loader.fp8_checkpoint import fp8_format, fp8_tensors
from radixlm.srt.model_loader.model_config import ModelConfig

if TYPE_CHECKING:  # opening a checkpoint (its config) needs no torch; reading its tensors imports it
    import torch


class HFCheckpoint:
    def __init__(self, path: str | Path, require_weights: bool = True):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{config_file} not found: a model directory needs a config.json", param="model_path")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_file} is not valid JSON: {e}", param="model_path") from e
        self.raw_config = raw
        self.config = ModelConfig.from_hf(raw)
        self.fp8 = fp8_format(raw)  # an FP8 checkpoint's format, else None
        gen_cfg = self.path / "generation_config.json"
        if gen_cfg.is_file():  # e.g. Llama 3 lists several end-of-turn ids here
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            for e in [eos] if isinstance(eos, int) else (eos or []):
                if e not in self.config.eos_token_ids:
                    self.config.eos_token_ids.append(e)
        self.files = self._weight_files() if require_weights else []

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.path / n for n in names]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(
                    f"weight file(s) listed in {index.name} are missing: {', '.join(missing)}", param="model_path"
                )
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in self.path.glob("*.bin"))
            hint = f" (found {', '.join(other)}: only safetensors is supported)" if other else ""
            raise ModelLoadError(f"no *.safetensors weights in {self.path}{hint}", param="model_path")
        return files

    def tensors(self, part=None) -> Iterator[tuple[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]:
        """Every tensor as stored; in an FP8 checkpoint each e4m3 weight paired with its per-channel scales.
        `part(name)`: the (rows, columns) slices of a tensor to read (tensor parallelism), or None for all of it;
        only that part is read from the file."""
        if self.fp8 is not None:
            yield from fp8_tensors(self.files, self.fp8, part)
            return
        from safetensors import safe_open  # noqa: PLC0415

        with tqdm(total=len(self.files), desc="Loading safetensors", unit="file", leave=False) as bar:
            for file in self.files:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        want = part(name) if part is not None else None
                        if want is None:
                            yield name, f.get_tensor(name)
                            continue
                        yield name, f.get_slice(name)[want]
                bar.update(1)

    def weights(self, dtype: torch.dtype, part=None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in `dtype` (FP8 weights dequantized with their scales); `part` as for tensors()."""
        from radixlm.srt.layers.quantization.fp8 import dequantize_rows

        for name, t in self.tensors(part):
            yield name, (dequantize_rows(*t) if isinstance(t, tuple) else t).to(dtype)

    def load_tokenizer(self, tokenizer_path: str | None = None):
        return load_tokenizer(tokenizer_path or str(self.path))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}", param="tokenizer_path") from e
