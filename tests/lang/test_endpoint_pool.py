"""RuntimeEndpoint's HTTP connection pool under run_batch, against a stub server (no model): every program thread
keeps its own kept-alive connection (no connect/close churn past httpx's default of 20 idle connections), and
more than httpx's default of 100 requests can be in flight at once."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import radixlm as sgl


class _Stub(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # accept backlog: many threads connect at once (uvicorn's is 2048)

    def __init__(self, delay: float):
        self.delay = delay
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
        time.sleep(srv.delay)  # every thread's request is in flight at once
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

    def start(delay: float) -> _Stub:
        srv = _Stub(delay)
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
    srv = stub(0.05)
    threads = 48
    states = _run_batch(srv, threads)
    assert [s["t2"] for s in states] == [" ok"] * threads
    assert srv.requests == 3 * threads
    assert srv.peak > 20  # the turns really overlapped beyond httpx's default keep-alive pool
    # 1 for /get_model_info, then at most one per thread; httpx's default pool (20 kept alive) opened ~3x more
    assert srv.connections <= 1 + threads


def test_run_batch_not_capped_at_100_requests_in_flight(stub):
    srv = stub(1.0)  # long enough that every thread's first turn overlaps even on a busy 2-core host
    _run_batch(srv, 128)
    assert srv.peak > 100  # httpx's default max_connections=100 queued the rest in the client
