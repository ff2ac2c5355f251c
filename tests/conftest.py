import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

# Triton fixes interpreter mode when it is first imported, and vLLM (imported by some test
# modules) imports it too: choose the interpreter here, before any test module is collected, so
# the kernel-logic tests run interpreted whatever subset and order pytest is given.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


# Environment variables that mok-serve sets and that change what later tests' servers and kernels
# do: a test that leaves one changed fails (a bind list leaked this way once made every later
# multi-rank CPU server bind to CPUs the machine lacks). Set them with monkeypatch, or in a server's
# own environment. (vLLM sets others of its own, process-wide, as it builds a config.)
GUARDED_ENV_PREFIXES = ("MOK_", "VLLM_CPU_", "VLLM_BATCH_INVARIANT", "VLLM_PLUGINS")


def _guarded_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith(GUARDED_ENV_PREFIXES)}


def restore_guarded_env(before: dict) -> list[str]:
    """Put the guarded variables back as ``before`` (``_guarded_env()`` then) held them; returns the
    names that had changed."""
    after = _guarded_env()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for key in changed:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    return changed


@pytest.fixture(autouse=True)
def environment_left_as_found():
    before = _guarded_env()
    yield
    changed = restore_guarded_env(before)
    if changed:
        pytest.fail(f"the test left {', '.join(changed)} changed in this process's environment (restored now); "
                    "set them with monkeypatch (setenv before delenv, so an unset one is unset again after)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_server():
    """``start(*args)`` runs mok-loadtest's fake server (loadtest/fake_server.py) on a free loopback
    port with those options and returns (process, url); every one started is stopped after the test."""
    from mok_serve import tiny_models
    from mok_serve.server_process import free_port

    procs = []

    def start(*args):
        port = free_port()
        root = str(tiny_models.build_tiny_model())
        p = subprocess.Popen([sys.executable, "-m", "mok_serve.loadtest.fake_server", "--port", str(port),
                              "--root", root, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                return p, f"http://127.0.0.1:{port}"
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("fake server did not start")

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
