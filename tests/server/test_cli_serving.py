"""The commands a new user types, on real CPU servers: the README's examples as written against
`mok-serve`'s embedded default, vLLM's own `vllm serve` and `vllm bench serve` with the kittens
backend, and what the server prints while it starts and stops."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serving_utils import greedy

from mok_serve import tiny_models
from mok_serve.kernels.cpu import moe as cpu_moe
from mok_serve.server_process import ServerProcess

pytestmark = pytest.mark.server

README = Path(__file__).parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"
VLLM = str(Path(sys.executable).with_name("vllm"))
# Lines that a start and stop of mok-serve must not print (vLLM's Triton notices on a CPU, the
# kernel build notice once the kernel is cached, Triton's binding leak report at exit).
NOISE = (
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed",
    "requires Triton",
    "compiling kittens' CPU kernel",
    "nanobind",
)


def readme_commands(prefix: str) -> list[str]:
    """The README's indented shell commands that start with ``prefix``, continuation lines joined."""
    commands, current = [], None
    for line in README.read_text().splitlines():
        text = line.strip()
        if current is not None:
            current += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                commands.append(current)
                current = None
        elif line.startswith("    ") and text.startswith(prefix):
            if text.endswith("\\"):
                current = text.rstrip("\\").strip()
            else:
                commands.append(text)
    return commands


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """`mok-serve` with no model, as the README's first command runs it (on a free port)."""
    assert cpu_moe.available()  # built before the server starts: it must then load silently
    server = ServerProcess(["--max-model-len", "1024"], log_path=tmp_path_factory.mktemp("log") / "mok-serve.log")
    with server:
        yield server


def test_readme_curl_examples_run_as_written(default_server):
    commands = readme_commands("curl ")
    assert commands, "the README shows no curl example"
    for command in commands:
        assert README_URL in command, command
        out = subprocess.run(
            ["bash", "-c", command.replace(README_URL, default_server.url)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert "error" not in answer, answer
        assert answer["model"] == tiny_models.served_name(tiny_models.DEFAULT_FAMILY)
        assert answer["choices"][0].get("text") or answer["choices"][0]["message"]["content"]


def test_start_and_stop_print_no_noise(default_server):
    default_server.stop()
    log = default_server.log()
    assert "Using KittensExperts MoE backend" in log and "Application shutdown complete" in log
    for line in NOISE:
        assert line not in log, line


def test_vllm_serve_and_vllm_bench_serve_run_kittens():
    model = str(tiny_models.build_tiny_model())
    with ServerProcess([model, "--moe-backend", "kittens", "--max-model-len", "1024"], command=[VLLM, "serve"]) as s:
        assert "Using KittensExperts MoE backend" in s.log()
        assert greedy(s, "The quick brown fox", max_tokens=8)
        out = subprocess.run(
            [VLLM, "bench", "serve", "--backend", "openai", "--base-url", s.url, "--model", model,
             "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
             "--num-prompts", "8", "--ignore-eos", "--disable-tqdm"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"Successful requests:\s+8\b", out.stdout), out.stdout
    assert re.search(r"Failed requests:\s+0\b", out.stdout), out.stdout
