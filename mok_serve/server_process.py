"""Start and stop a `mok-serve` server in a child process, on loopback (tests and load tests).

The server runs in its own process group so that stopping it also ends vLLM's engine and worker
processes; the shared-memory segments vLLM's CPU backend leaves behind are removed afterwards.
"""

import glob
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class ServerProcess:
    """``with ServerProcess(["--moe-backend", "kittens"]) as server: server.url ...``

    ``args`` are `mok-serve` arguments (a model, or none for the embedded default, and any
    `vllm serve` option). The log goes to ``log_path`` (a temporary file by default).
    """

    def __init__(
        self,
        args: list[str] = (),
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout: float = 600.0,
    ):
        self.args = list(args)
        self.port = port or free_port()
        self.env = {**os.environ, **CPU_ENV, **(env or {})}
        self.log_path = Path(log_path or f"/tmp/mok-serve-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "mok_serve.cli", *self.args, "--host", HOST, "--port", str(self.port)]
        self._log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        self.stop()
        raise ServerError(f"server not healthy after {self.startup_timeout:.0f} s:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float) -> int:
        """Wait for a server expected to fail at start-up; returns its exit code."""
        try:
            return self.proc.wait(timeout)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # Workers of a TP>1 CPU server may outlive the group leader for a moment.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        self._log_file.close()
        for segment in glob.glob(f"/dev/shm/vllm_*{self.port}*"):
            Path(segment).unlink(missing_ok=True)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
