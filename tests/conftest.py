import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# On a GPU the exact-output tests run in float32 (RADIXLM_TEST_DTYPE=float32): the embedded 135M model has
# near-ties (0.08 nats between its two likeliest first answer tokens) that bf16 rounding can flip.
TEST_DTYPE = os.environ.get("RADIXLM_TEST_DTYPE", "auto")

import radixlm  # noqa: E402,F401 - first, as users import it: OpenMP's passive wait is set before torch loads it

try:  # without a GPU, Triton kernels run in its interpreter; this must be set before they are imported
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


@pytest.fixture(scope="session")
def smol_engine():
    """One SmolLM2 Engine shared by tests that only generate (they must leave it idle and clean)."""
    import radixlm

    # Jump-forward on under overlap scheduling too (the CUDA default), so the grammar tests test it there as well.
    engine = radixlm.Engine(log_level="warning", max_total_tokens=16384, dtype=TEST_DTYPE, jump_forward="on")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random checkpoints of every supported architecture, built once per session."""
    from tests.helpers import TINY_ARCHS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch, tie=arch == "qwen3") for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def server():
    """One launched server (default model) shared by the HTTP test files; must shut down cleanly."""
    from tests.helpers import ServerProcess

    srv = ServerProcess("--max-total-tokens", "20000")
    yield srv
    assert srv.stop() == 0
