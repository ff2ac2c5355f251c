"""``MOK_DETERMINISTIC_FP8_GEMM=cutlass`` on a Hopper GPU: vLLM's CUTLASS blockwise GEMM, as the
deterministic glue calls it, on the layers ``cutlass_is_invariant`` admits. Accuracy against float64
on the same quantized operands (NaN fails), and the whole output of every prefix of a batch
bitwise equal to the batch's own rows, call after call: a row's bits do not depend on the rows
beside it. Compared as whole outputs: a bf16 output hides most fp32 reorderings, so one row would
say little.

Run with ``pytest -m gpu`` where vLLM imports (the device kit); skipped elsewhere. Fresh random
inputs each run (seed printed).
"""

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs a Hopper (sm90) GPU", allow_module_level=True)
pytest.importorskip("vllm")

from mok_serve.kernels.fp8 import quantize_fp8_blocks  # noqa: E402
from mok_serve.vllm import deterministic  # noqa: E402
from moe_test_utils import DEV, fresh_seed, rel_err  # noqa: E402
from moe_test_utils import fp8_linear_float64_reference as float64_reference  # noqa: E402

# [N, K] with K <= 3N: Qwen3-30B-A3B-FP8 qkv / o, DeepSeek-V3 q_b / o / shared-expert gate_up and down.
SHAPES = [(5120, 2048), (2048, 4096), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048)]
PREFIXES = [1, 2, 3, 17, 64, 200, 257, 777, 2048]


@pytest.mark.parametrize("n,k", SHAPES)
def test_cutlass_rows_keep_their_bits_whatever_the_batch(n, k):
    major, minor = torch.cuda.get_device_capability()
    assert deterministic.cutlass_is_invariant(n, k, SimpleNamespace(major=major, minor=minor))
    gen = torch.Generator(device=DEV).manual_seed(fresh_seed())
    wq, ws = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=gen) / k**0.5)
    x = torch.randn(PREFIXES[-1], k, device=DEV, generator=gen).to(torch.bfloat16)
    full = deterministic.vllm_cutlass_linear_fp8(x, wq, ws, None)
    assert full.shape == (PREFIXES[-1], n) and full.dtype == torch.bfloat16
    assert not torch.isnan(full).any()
    assert rel_err(full, float64_reference(x, wq, ws, None)) <= 1e-2
    assert torch.equal(deterministic.vllm_cutlass_linear_fp8(x, wq, ws, None), full)
    for rows in PREFIXES[:-1]:
        out = deterministic.vllm_cutlass_linear_fp8(x[:rows], wq, ws, None)
        assert torch.equal(out, full[:rows]), (n, k, rows, (out != full[:rows]).sum().item())
        tail = deterministic.vllm_cutlass_linear_fp8(x[-rows:], wq, ws, None)
        assert torch.equal(tail, full[-rows:]), (n, k, -rows)


def test_cutlass_bias_is_added_per_row():
    gen = torch.Generator(device=DEV).manual_seed(fresh_seed())
    n, k = 2048, 4096
    wq, ws = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=gen) / k**0.5)
    x = torch.randn(3, 5, k, device=DEV, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=gen).to(torch.bfloat16)
    out = deterministic.vllm_cutlass_linear_fp8(x, wq, ws, b)
    assert out.shape == (3, 5, n)
    assert rel_err(out.reshape(15, n), float64_reference(x.reshape(15, k), wq, ws, b)) <= 1e-2
