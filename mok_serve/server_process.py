"""Start and stop a `mok-serve` server in a child process, on loopback (tests and load tests).

The server runs in its own session and process group so that stopping it also ends vLLM's engine
and worker processes; the shared-memory segments they leave behind are removed afterwards.
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
SHM_DIR = "/dev/shm"
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


def session_shm_segments(sid: int) -> set[str]:
    """Files under /dev/shm mapped by the live processes of session ``sid`` (Linux ``/proc``).

    vLLM 0.32's CPU backend names its segments from random ids, not from the server's port: the TP
    SHM communicator's ``vllm_dist_<uuid4 hex>-<group>-[<ranks>]-cpushm_<rank>`` (the file-store
    rendezvous name, ``VLLM_DIST_IDENT``) and the message queues' ``psm_<random>``. So no name
    pattern picks out one server's segments; the mappings of the server's own processes do.
    """
    found: set[str] = set()
    for stat_path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat_path) as f:
                # pid (comm) state ppid pgrp session ...; comm may contain spaces and parentheses.
                if int(f.read().rsplit(")", 1)[1].split()[3]) != sid:
                    continue
            with open(os.path.join(os.path.dirname(stat_path), "maps")) as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    path = parts[5].rstrip("\n") if len(parts) == 6 else ""
                    if path.startswith(SHM_DIR + "/") and not path.endswith(" (deleted)"):
                        found.add(path)
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not readable
    return found


def remove_leftover_segments(segments: set[str], sid: int, wait_s: float = 5.0) -> set[str]:
    """Unlink ``segments`` once no process of session ``sid`` maps them any more (waiting up to
    ``wait_s`` for killed processes to go); returns those still mapped, which are kept."""
    deadline = time.monotonic() + wait_s
    while (busy := segments & session_shm_segments(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for segment in segments - busy:
        Path(segment).unlink(missing_ok=True)
    return busy


class ServerProcess:
    """``with ServerProcess(["--moe-backend", "kittens"]) as server: server.url ...``

    ``args`` are `mok-serve` arguments (a model, or none for the embedded default, and any
    `vllm serve` option). ``command`` runs another server command with them instead, such as
    ``["vllm", "serve"]``. The log goes to ``log_path`` (a temporary file by default).
    """

    def __init__(
        self,
        args: list[str] = (),
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout: float = 600.0,
        cpus: set[int] | None = None,
        command: list[str] | None = None,
    ):
        self.args = list(args)
        self.command = list(command or [sys.executable, "-m", "mok_serve.cli"])
        self.port = port or free_port()
        self.env = {**os.environ, **CPU_ENV, **(env or {})}
        self.log_path = Path(log_path or f"/tmp/mok-serve-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.cpus = cpus  # pin every process of the server to these CPUs (benchmarks)
        self.proc: subprocess.Popen | None = None
        self._shm: set[str] = set()  # shared-memory segments the server's processes mapped

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> "ServerProcess":
        cmd = [*self.command, *self.args, "--host", HOST, "--port", str(self.port)]
        self._log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        self._shm |= session_shm_segments(self.proc.pid)
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        self.stop()
        raise ServerError(f"server not healthy after {self.startup_timeout:.0f} s:\n{self.log()[-4000:]}")

    def pause(self) -> None:
        """Freeze every process of the server (SIGSTOP to its process group): a benchmark of another
        server on the same cores then runs undisturbed (no polling, no periodic logging)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        sid = self.proc.pid  # start_new_session: the server leads its own session and process group
        self._shm |= session_shm_segments(sid)
        try:
            self.resume()  # a paused server would not act on SIGTERM
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
        self._shm = remove_leftover_segments(self._shm, sid)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
