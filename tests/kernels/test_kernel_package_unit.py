"""The ops run the installed package's code even where the checkout's ``kernels/`` folder is also
imported as a top-level ``kernels`` (transformers' probe for the Hugging Face package does that
when the checkout's root is on sys.path: ``python -m`` run from it, pytest)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Imports both copies in the given order, marks the installed package's reference dense layer, and
# prints what the op returns (a CPU call runs the reference of the module that defined the op).
PROBE = """
import importlib, sys, torch
for name in sys.argv[1:]:
    importlib.import_module(name)
import kernels, mok_serve.kernels as installed
assert kernels is not installed and kernels.__file__ == installed.__file__
installed.invariant_linear_reference = lambda x, w, b: torch.full((x.shape[0], w.shape[0]), 7.0)
print(float(torch.ops.mok_serve.invariant_linear(torch.ones(2, 4), torch.ones(3, 4), None)[0, 0]))
"""


@pytest.mark.parametrize("order", [("kernels", "mok_serve.kernels"), ("mok_serve.kernels", "kernels")])
def test_ops_run_the_installed_package_whichever_copy_came_first(order):
    run = subprocess.run([sys.executable, "-c", PROBE, *order], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "7.0", run.stdout
