"""loadtest/device_model.sh, the model preparation h200_serving.sh and h200_check.sh share: the
path a shape and WEIGHT_GIB give, the build-model call, and MHA attention for DeepSeek shapes."""
import os
import pathlib
import shutil
import subprocess

import pytest

HELPER = pathlib.Path(__file__).parents[2] / "loadtest" / "device_model.sh"


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs util-linux's flock")
@pytest.mark.parametrize("shape, weight_gib, mla_disabled", [
    ("deepseek-v3-fp8", "40", "1"), ("qwen3-30b-a3b", "", "unset")])
def test_device_model_builds_the_shape_once_at_its_path(tmp_path, shape, weight_gib, mla_disabled):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "mok-serve"  # stands in for build-model: records its arguments
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "WEIGHT_GIB": weight_gib}
    env.pop("VLLM_MLA_DISABLE", None)
    out = subprocess.run(["bash", "-c", f'source {HELPER}; device_model {shape}; '
                          'echo "$model ${VLLM_MLA_DISABLE:-unset}"'],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    path = f"/tmp/models/{shape}-{weight_gib}" if weight_gib else f"/tmp/models/{shape}"
    assert out == [path, mla_disabled]
    expected = f"build-model --shape {shape} --out {path}" + (f" --weight-gib {weight_gib}" if weight_gib else "")
    assert calls.read_text().splitlines() == [expected]
