import ctypes
import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent under other C libraries

import radixlm  # noqa: E402,F401 - first, as users import it: OpenMP's passive wait is set before torch loads it

# The slowest files first (their durations on the 2-core CI machine, longest first): `--dist loadfile` hands files
# to the two workers in collection order, so a heavy file collected last (the tensor-parallel ones sort late)
# used to run alone at the end while the other worker sat idle. Files not named keep their order after these.
_SLOWEST_FIRST = (
    "srt/test_router.py",
    "srt/test_server_api.py",
    "srt/test_speculative.py",
    "examples/test_examples.py",
    "srt/test_tensor_parallel.py",
    "srt/test_extend_graph.py",
    "srt/test_model_correctness.py",
    "constrained/test_json_schema_corpus.py",
    "srt/test_attention_backends.py",
    "srt/test_tp_server.py",
    "constrained/test_real_world_schemas.py",
    "constrained/test_openai_tools.py",
    "srt/test_tp_multinode.py",
    "srt/test_quantization.py",
    "srt/test_server_lifecycle.py",
    "srt/test_engine.py",
    "constrained/test_grammar_scheduler.py",
    "lang/test_sglang_api.py",
)


def pytest_configure(config):
    # xdist (3.x) hands out the files with the most tests first unless told not to, which undid this order: the
    # few-test, many-process files (router, tensor parallel) ran last, side by side, when both workers had grown
    # largest, and a 24 GiB CI machine ran out of memory. Set here, not in addopts: the GPU machine has no xdist.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    tests = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}

    def order(item) -> int:
        try:
            return rank.get(Path(str(item.fspath)).resolve().relative_to(tests).as_posix(), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=order)  # stable: every file's tests keep their order


try:  # without a GPU, Triton kernels run in its interpreter; this must be set before they are imported
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory():
    """After each test file, hand the heap it freed back to the system: glibc keeps it for reuse, so the two
    workers only grew, file after file, beside the servers and ranks tests start (test_grammar_scheduler.py run
    alone ends with 1.76 GiB resident, 0.90 GiB after the trim). gc first: cycles (an engine and its threads)
    hold much of it."""
    yield
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def smol_engine():
    """One SmolLM2 Engine shared by tests that only generate (they must leave it idle and clean)."""

    # Jump-forward on under overlap scheduling too (the CUDA default), so the grammar tests test it there as well.
    engine = radixlm.Engine(log_level="warning", max_total_tokens=16384, jump_forward="on")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def fp32_engine(smol_engine):
    """The embedded model with fp32 weights and activations (`quantization="none"`), for tests against fp32
    references: the session's engine where `auto` chose that, else one of its own."""

    if smol_engine.loaded.quantization == "none" and smol_engine.runner.dtype == torch.float32:
        yield smol_engine
        return
    engine = radixlm.Engine(log_level="warning", max_total_tokens=4096, dtype="float32", quantization="none")
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
    """One launched server (default model, fp32: the frontend-language tests compare its answers with the fp32
    engine's) shared by the HTTP test files; must shut down cleanly. The overlap servers of test_server_api run
    the default quantization."""
    from tests.helpers import ServerProcess

    srv = ServerProcess("--max-total-tokens", "20000", "--quantization", "none")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def url(server):
    """The shared server's URL for one test file, which must leave nothing running, queued or holding KV."""
    from tests.helpers import assert_server_idle

    yield server.url
    assert_server_idle(server.url)
