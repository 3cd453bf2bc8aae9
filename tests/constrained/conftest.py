"""Engines shared by the constrained-decoding tests: one per grammar backend (jump-forward on), built when a test
first needs it and kept for this package, so that each loads once. The session's `smol_engine` runs the default
backend, `auto`.

Their compile limit is generous: outlines takes seconds per nested schema on one core, and the corpus tests send
a few dozen at once to a 2-core host; these tests are about what the grammars let through. The limit itself is
tested with its own engines (test_grammar_scheduler)."""

import pytest

import radixlm
from tests.helpers import GRAMMAR_BACKENDS

COMPILE_LIMIT_S = 180.0


@pytest.fixture(scope="package")
def backend_engines():
    made = {}

    def get(backend: str):
        if backend not in made:
            made[backend] = radixlm.Engine(
                grammar_backend=backend,
                log_level="warning",
                max_total_tokens=16384,
                jump_forward="on",
                grammar_compile_timeout=COMPILE_LIMIT_S,
            )
        return made[backend]

    yield get
    for e in made.values():
        e.shutdown()


@pytest.fixture(params=GRAMMAR_BACKENDS)
def engine(request, backend_engines):
    """The engine of each backend: jump-forward on."""
    e = backend_engines(request.param)
    assert e.server_args.grammar_backend == request.param
    assert e.scheduler.grammar.jump_forward
    return e
