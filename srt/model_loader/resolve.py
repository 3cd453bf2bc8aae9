"""Where a model's files are and what it is (its config), without torch: the HTTP process resolves its model
before it starts the scheduler, and nothing on that path needs the tensors."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from radixlm.srt.errors import ModelLoadError
from radixlm.srt.model_loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from radixlm.srt.model_loader.gguf_loader import GGUFCheckpoint
from radixlm.srt.model_loader.hf_loader import HFCheckpoint
from radixlm.srt.model_loader.model_config import ModelConfig


@dataclass
class ResolvedModel:
    """Where a model's files are, found once by the launching process and handed to its children."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    config: ModelConfig


def resolve_model(
    model_path: str | None,
    tokenizer_path: str | None = None,
    served_model_name: str | None = None,
    load_format: str = "auto",
) -> ResolvedModel:
    """Download the default model if needed and make sure a plain tokenizer directory exists."""
    ckpt, resolved, name = open_checkpoint(model_path, dummy=load_format == "dummy")
    if tokenizer_path is None:
        tokenizer_path = str(ckpt.tokenizer_dir() if isinstance(ckpt, GGUFCheckpoint) else ckpt.path)
    return ResolvedModel(resolved, tokenizer_path, served_model_name or name, ckpt.config)


def open_checkpoint(model_path: str | None, dummy: bool = False) -> tuple[GGUFCheckpoint | HFCheckpoint, str, str]:
    """Returns (checkpoint, resolved path, served model name)."""
    if not model_path:
        path = default_model_path()
        return GGUFCheckpoint(path), str(path), DEFAULT_MODEL_NAME
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {model_path!r} does not exist (no Hugging Face hub access: "
            "give a local directory or .gguf file)",
            param="model_path",
        )
    name = path.stem if path.is_file() else path.name
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {model_path!r} is not a .gguf file", param="model_path")
        return GGUFCheckpoint(path), str(path), name
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists() and len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0]), str(ggufs[0]), name
    return HFCheckpoint(path, require_weights=not dummy), str(path), name
