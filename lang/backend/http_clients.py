"""HTTP clients for `RuntimeEndpoint`, lent to one request at a time.

run_batch and fork call the endpoint from many threads at once. One `httpx.Client` shared by those threads is
not safe under load: its connection pool decides that a kept-alive connection has expired (or that the server
closed it) from state it reads without the connection's lock, so one thread can close a connection another
thread has just taken and is sending on ("ReadError: [Errno 9] Bad file descriptor"). Here every request
borrows a whole client (in practice one kept-alive connection) that no other thread touches until it is given
back; idle clients are reused newest first, so a run_batch of N threads keeps about N connections open however
many programs it runs.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from radixlm.lang.backend.base import LangError

# Idle connections expire after 4 s, before uvicorn's default 5 s keep-alive closes them: at equal timeouts a
# POST can go out on a connection the server is closing, and httpx does not resend a POST ("Server disconnected
# without sending a response").
KEEPALIVE_EXPIRY_S = 4.0


class ClientPool:
    def __init__(
        self,
        base_url: str,
        headers: dict,
        timeout: float,
        verify: bool | str | ssl.SSLContext,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_S,
    ):
        # One TLS context for all clients: httpx builds a fresh one per client otherwise (tens of ms each).
        ctx = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
        self._kw = dict(
            base_url=base_url,
            headers=headers,
            timeout=timeout,
            verify=ctx,
            limits=httpx.Limits(keepalive_expiry=keepalive_expiry),
        )
        self._idle: list[httpx.Client] = []
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def lend(self) -> Iterator[httpx.Client]:
        """A client for one request (streamed or not); given back, or closed after `close`, when it ends."""
        with self._lock:
            if self._closed:
                raise LangError("this endpoint was shut down")
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = httpx.Client(**self._kw)
        try:
            yield client
        finally:
            with self._lock:
                keep = not self._closed
                if keep:
                    self._idle.append(client)
            if not keep:
                client.close()

    def close(self) -> None:
        """Close the idle clients now and those lent out as their requests end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()
