"""`sgl.global_config`, as SGLang programs reach for it: the default backend, and how much a run prints.

The one piece of process-wide state the language keeps, because SGLang's API is built on it
(`set_default_backend`, `global_config.default_backend.token_usage`); everything else is passed explicitly.
"""

from __future__ import annotations

from radixlm.lang.backend.base import Backend, LangError


def to_backend(backend) -> Backend:
    """A Backend as is; a radixlm.Engine wrapped to run in-process."""
    if isinstance(backend, Backend):
        return backend
    if type(backend).__name__ == "Engine" and hasattr(backend, "add_request"):
        from radixlm.lang.backend.native import EngineBackend

        return EngineBackend(backend)
    raise LangError(f"not a backend: {type(backend).__name__} (use RuntimeEndpoint, Runtime, OpenAI or an Engine)")


class GlobalConfig:
    def __init__(self) -> None:
        self._default_backend: Backend | None = None
        self.verbosity = 0  # 2 or more: print each program's text when its run() ends (as SGLang does)

    @property
    def default_backend(self) -> Backend | None:
        """The backend programs run on when run() is given none."""
        return self._default_backend

    @default_backend.setter
    def default_backend(self, backend) -> None:
        self._default_backend = None if backend is None else to_backend(backend)


global_config = GlobalConfig()
