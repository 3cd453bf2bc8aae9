"""Engines shared by the constrained-decoding tests: the session's outlines engine (`smol_engine`) and one
xgrammar engine for this package, so that it loads once."""
import pytest

import radixlm
from tests.helpers import GRAMMAR_BACKENDS


@pytest.fixture(scope="package")
def xgrammar_engine():
    engine = radixlm.Engine(grammar_backend="xgrammar", log_level="warning", max_total_tokens=16384,
                            enable_jump_forward=True)
    yield engine
    engine.shutdown()


@pytest.fixture(params=GRAMMAR_BACKENDS)
def engine(request):
    """The engine of each backend: jump-forward on, the default compile timeout."""
    e = request.getfixturevalue("smol_engine" if request.param == "outlines" else "xgrammar_engine")
    assert e.server_args.grammar_backend == request.param
    assert e.scheduler.grammar.jump_forward
    return e
