"""RuntimeEndpoint's HTTP clients under run_batch, against a stub server (no model): a run_batch of N threads
keeps about N kept-alive connections (no connect/close churn past httpx's default of 20 idle connections), more
than httpx's default of 100 requests can be in flight at once, and no client (so no connection) is ever used by
two requests at once (a shared httpx pool let one thread close a connection another had just taken).

The stub holds each generate request at a barrier until `gather` of them are in flight, so the overlap the
assertions need is made by the stub, not hoped for from a sleep: a client that cannot have `gather` requests
open at once leaves the barrier to time out, and the peak it reached is what the test reports."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import radixlm as sgl

_GATHER_TIMEOUT_S = 30.0  # generous for a loaded 2-core host; only a client that caps concurrency waits it out


class _Stub(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # accept backlog: many threads connect at once (uvicorn's is 2048)

    def __init__(self, gather: int):
        # Broken (not waited on again) after one timeout: a client capped below `gather` then fails fast.
        self.barrier = threading.Barrier(gather, timeout=_GATHER_TIMEOUT_S)
        self.lock = threading.Lock()
        self.connections = self.requests = self.in_flight = self.peak = 0
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def log_message(self, *args):
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"model_path": "stub", "chat_template": None})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        srv = self.server
        with srv.lock:
            srv.requests += 1
            srv.in_flight += 1
            srv.peak = max(srv.peak, srv.in_flight)
        try:
            srv.barrier.wait()  # released only when `gather` requests are open at once
        except threading.BrokenBarrierError:
            pass  # answered anyway; the test reads the peak that was reached
        with srv.lock:
            srv.in_flight -= 1
        self._send(
            {
                "text": " ok",
                "meta_info": {
                    "prompt_tokens": 1,
                    "completion_tokens": 1,
                    "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": 1},
                },
            }
        )


@pytest.fixture
def stub():
    servers = []

    def start(gather: int) -> _Stub:
        srv = _Stub(gather)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@sgl.function
def three_turns(s, i):
    for turn in range(3):
        s += f"Program {i} turn {turn}:" + sgl.gen(f"t{turn}", max_tokens=1)


def _run_batch(srv: _Stub, n: int) -> list:
    """`three_turns` for n programs on n threads against the stub; every program must succeed."""
    be = sgl.RuntimeEndpoint(f"http://127.0.0.1:{srv.server_address[1]}")
    try:
        states = three_turns.run_batch([{"i": i} for i in range(n)], backend=be, num_threads=n)
    finally:
        be.shutdown()
    assert [s.error for s in states] == [None] * n
    return states


def test_run_batch_reuses_one_connection_per_thread(stub):
    threads = 48
    srv = stub(threads)  # each turn of all 48 programs is in flight at once, beyond httpx's 20 kept alive
    states = _run_batch(srv, threads)
    assert [s["t2"] for s in states] == [" ok"] * threads
    assert srv.requests == 3 * threads
    assert srv.peak == threads
    # 1 for /get_model_info, then at most one per thread; httpx's default pool (20 kept alive) opened ~3x more
    assert srv.connections <= 1 + threads


def test_run_batch_not_capped_at_100_requests_in_flight(stub):
    srv = stub(128)
    _run_batch(srv, 128)
    assert srv.peak == 128  # httpx's default max_connections=100 would queue 28 in the client: the barrier breaks


def test_client_pool_lends_each_client_to_one_request_at_a_time():
    from radixlm.lang.backend.http_clients import ClientPool

    pool = ClientPool("http://127.0.0.1:9", {}, 5.0, True)
    threads, rounds = 16, 50
    in_use: set[int] = set()
    seen: set[int] = set()
    lock = threading.Lock()
    clashes = []
    start = threading.Barrier(threads)

    def borrow():
        start.wait()
        for _ in range(rounds):
            with pool.lend() as client:
                with lock:
                    if id(client) in in_use:
                        clashes.append(id(client))
                    in_use.add(id(client))
                    seen.add(id(client))
                time.sleep(0)  # let the other threads run while this one holds the client
                with lock:
                    in_use.discard(id(client))

    workers = [threading.Thread(target=borrow) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert clashes == []
    assert len(seen) <= threads  # given back and reused, not one client per request
    with pool.lend() as client:
        assert id(client) in seen  # an idle client is lent again
    pool.close()
    assert client.is_closed
    with pytest.raises(sgl.LangError, match="shut down"):
        with pool.lend():
            pass


class _QuickHandler(_Handler):
    def do_POST(self):  # answered at once: no barrier
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.requests += 1
        self._send({"text": " ok"})


def test_client_pool_survives_connections_expiring_under_many_threads(stub):
    """The shape of the CI failure (one of 128 programs: "ReadError: [Errno 9] Bad file descriptor"): kept-alive
    connections expiring while many threads send. Expiry of 2 ms makes every idle gap an expiry; a single httpx
    client shared by these threads failed ~1 request in 150 here, each with that error."""
    from radixlm.lang.backend.http_clients import ClientPool

    srv = stub(1)
    srv.RequestHandlerClass = _QuickHandler
    pool = ClientPool(f"http://127.0.0.1:{srv.server_address[1]}", {}, 30.0, True, keepalive_expiry=0.002)
    threads, requests = 32, 50
    errors = []

    def send():
        for _ in range(requests):
            try:
                with pool.lend() as client:
                    assert client.post("/generate", json={}).json() == {"text": " ok"}
            except Exception as e:  # noqa: BLE001 - every failure is what the test reports
                errors.append(f"{type(e).__name__}: {e}")

    workers = [threading.Thread(target=send) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    pool.close()
    assert errors == []
    assert srv.requests == threads * requests
