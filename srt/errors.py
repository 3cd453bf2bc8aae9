"""Typed errors raised at the edge; the HTTP layer maps each to an OpenAI-shaped 4xx body."""

from __future__ import annotations


class RadixLMError(Exception):
    """Base class. `status` is the HTTP status, `type`/`code` the OpenAI error fields."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(RadixLMError):
    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class GrammarError(InvalidRequest):
    code = "invalid_grammar"


class GrammarTimeout(GrammarError):
    """A compile that ran past --grammar-compile-timeout: the grammar is too complex to serve."""


class GrammarWorkersBusy(GrammarError):
    """No compile worker came free within the time limit (slow compiles held them all): the server's state, not
    a fault of the request."""

    status = 503
    type = "server_overloaded"
    code = "grammar_workers_busy"


class ModelLoadError(RadixLMError):
    """A model path, file or architecture that cannot be loaded (raised at start-up, not per request)."""

    status = 500
    type = "model_load_error"


class Overloaded(RadixLMError):
    status = 503
    type = "server_overloaded"
    code = "overloaded"
