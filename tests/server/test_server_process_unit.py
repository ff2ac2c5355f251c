"""ServerProcess's shared-memory clean-up, without a server: a child in its own session maps
segments named like those vLLM's CPU backend leaves behind; stopping it removes exactly those,
not the segments of another process (another server)."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mok_serve.server_process import SHM_DIR, ServerProcess, remove_leftover_segments, session_shm_segments

pytestmark = pytest.mark.skipif(
    not (os.path.isdir(SHM_DIR) and os.path.exists("/proc/self/maps")), reason="needs Linux /dev/shm and /proc"
)

# Creates and maps each named segment (as vLLM's C++ SHM manager does), then waits to be stopped.
CHILD = r"""
import mmap, os, sys, time
maps = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


def _names(n):
    ident = f"vllm_dist_{uuid.uuid4().hex}"
    return {f"{SHM_DIR}/{ident}-tp:0-[0-{n - 1}]-cpushm_{rank}" for rank in range(n)}


@pytest.fixture
def segments():
    created = []

    def start(paths):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, *sorted(paths)], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        created.append((child, paths))
        assert child.stdout.readline().strip() == "ready"
        return child

    yield start
    for child, paths in created:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
        child.stdout.close()
        for p in paths:
            Path(p).unlink(missing_ok=True)


def test_segments_of_a_session_are_removed_only_once_unmapped(segments):
    mine, other = _names(2), _names(2)
    child = segments(mine)
    another = segments(other)  # another server, still running
    assert session_shm_segments(child.pid) == mine
    assert remove_leftover_segments(mine, child.pid, wait_s=0) == mine  # still mapped: kept
    assert all(Path(p).exists() for p in mine)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(10)
    assert remove_leftover_segments(mine, child.pid) == set()
    assert not any(Path(p).exists() for p in mine)
    assert all(Path(p).exists() for p in other) and another.poll() is None


def test_stop_removes_the_server_s_leftover_segments(segments, tmp_path):
    mine, other = _names(2), _names(2)
    server = ServerProcess(log_path=tmp_path / "server.log")
    server.proc = segments(mine)  # stands in for a running server (SIGTERM ends it, segments stay)
    server._log_file = open(server.log_path, "w")
    segments(other)
    server.stop()
    assert server.proc is None
    assert not any(Path(p).exists() for p in mine)
    assert all(Path(p).exists() for p in other)
