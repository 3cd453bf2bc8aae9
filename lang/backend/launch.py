"""Starting and stopping a server subprocess for `Runtime`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from radixlm._net import free_local_port
from radixlm.lang.backend.base import LangError


@dataclass
class ServerProcess:
    popen: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)  # the server's clean shutdown path
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def launch_server(model_path, port, timeout, api_key, server_args: dict) -> tuple[ServerProcess, str]:
    import httpx

    port = port or free_local_port()
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(port), "--host", "127.0.0.1"]
    if model_path:
        cmd += ["--model-path", str(model_path)]
    if api_key:
        cmd += ["--api-key", api_key]
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value not in (False, None):
            cmd += [flag, str(value)]
    log = tempfile.NamedTemporaryFile(prefix="radixlm-runtime-", suffix=".log", delete=False)
    proc = ServerProcess(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()), log.name)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None:
            raise LangError(f"the server exited with code {proc.popen.returncode} while starting:\n{proc.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.stop()
            raise LangError(f"the server did not come up within {timeout:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.5)
