"""Tensor parallelism across hosts, on one machine: two `radixlm serve --nnodes 2` processes meeting over
127.0.0.1 (node 0 serves HTTP and schedules, node 1 runs its rank and a /health stub) answer as one unsharded
engine does; node 1 ends cleanly when node 0 stops; a node whose --dist-init-addr leads nowhere fails within
its --dist-timeout with a message naming the likely cause."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai

import radixlm
from tests.helpers import ServerProcess, free_port


def test_two_nodes_serve_as_one_engine(tiny_dirs):
    path = str(tiny_dirs["llama"])
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model-path", path, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    common += ["--max-total-tokens", "4096", "--dist-timeout", "120"]
    node1 = ServerProcess(*common, "--node-rank", "1")  # its /health stub answers once its rank is started
    node0 = ServerProcess(*common, "--node-rank", "0")
    try:
        assert httpx.get(f"{node1.url}/health", timeout=5).status_code == 200
        client = openai.OpenAI(base_url=f"{node0.url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.completions.create(model="llama", prompt="The quick brown fox", max_tokens=12, temperature=0)
        assert node0.stop() == 0
        assert node1.proc.wait(timeout=30) == 0  # rank 0 stopped it
    finally:
        for srv in (node0, node1):
            if srv.proc.poll() is None:
                srv.proc.kill()
    one = radixlm.Engine(path, log_level="warning", max_total_tokens=4096)
    want = one.generate("The quick brown fox", {"temperature": 0, "max_new_tokens": 12})["text"]
    one.shutdown()
    assert got.choices[0].text == want and got.usage.completion_tokens == 12


def test_unreachable_group_fails_within_the_timeout(tiny_dirs):
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--model-path", str(tiny_dirs["llama"]), "--port",
           str(free_port()), "--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr",
           f"127.0.0.1:{free_port()}", "--dist-timeout", "2"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "could not reach its group" in proc.stderr and "GLOO_SOCKET_IFNAME" in proc.stderr
