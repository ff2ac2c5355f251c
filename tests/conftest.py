import os

import pytest
import torch

# Triton fixes interpreter mode when it is first imported, and vLLM (imported by some test
# modules) imports it too: choose the interpreter here, before any test module is collected, so
# the kernel-logic tests run interpreted whatever subset and order pytest is given.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
