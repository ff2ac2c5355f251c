"""loadtest/h200_serving.sh's server names: which mok-serve command line (and FP8 GEMM choice) each
BACKEND starts, and a clear refusal of a name it does not know. mok-serve is a stand-in that records
its arguments and exits, so the script stops at its wait for the server."""
import os
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "loadtest" / "h200_serving.sh"
pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="needs util-linux's flock (device_model.sh)")


def run_script(tmp_path, backends):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "mok-serve"
    fake.write_text(f'#!/bin/sh\necho "${{MOK_DETERMINISTIC_FP8_GEMM:-kittens}} $*" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PORT": "1", "MOK_COMMIT": "test"}
    env.pop("MOK_DETERMINISTIC_FP8_GEMM", None)
    proc = subprocess.run(["bash", str(SCRIPT), "qwen3-30b-a3b", backends, str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)
    serves = [line for line in calls.read_text().splitlines() if "build-model" not in line] if calls.exists() else []
    return proc, serves


@pytest.mark.parametrize("backend, gemm, moe, deterministic", [
    ("stock", "kittens", "auto", False),
    ("stock-deterministic", "kittens", "auto", True),
    ("kittens", "kittens", "kittens", False),
    ("kittens-deterministic", "kittens", "kittens", True),
    ("kittens-deterministic-cutlass", "cutlass", "kittens", True),
])
def test_each_backend_starts_its_server(tmp_path, backend, gemm, moe, deterministic):
    proc, serves = run_script(tmp_path, backend)
    assert proc.returncode == 1  # the stand-in exits: the wait for the server gives up at once
    assert len(serves) == 1
    words = serves[0].split()
    assert words[0] == gemm and words[words.index("--moe-backend") + 1] == moe
    assert ("--deterministic" in words) == deterministic
    assert words[words.index("--served-model-name") + 1] == "qwen3-30b-a3b"


@pytest.mark.parametrize("backend", ["stock-deterministic-cutlass", "kittens-fast", "kittens-deterministic-x"])
def test_an_unknown_backend_is_refused_by_name(tmp_path, backend):
    proc, serves = run_script(tmp_path, backend)
    assert proc.returncode == 2 and serves == []
    assert "BACKEND must be stock or kittens" in proc.stderr
