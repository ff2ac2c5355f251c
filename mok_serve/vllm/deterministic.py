"""Deterministic serving: vLLM's batch-invariant mode with kittens' faster invariant kernels.

``mok-serve --deterministic`` (or ``VLLM_BATCH_INVARIANT=1 vllm serve MODEL --moe-backend kittens``)
runs vLLM's batch-invariant mode (``vllm/model_executor/determinism/batch_invariant.py``: invariant
attention, norms, softmax and sampling ops, NCCL and all-reduce pinned) with the kittens experts,
which need no invariant fallback, and puts kittens' batch-invariant dense layer
(``mok_serve.kernels.invariant_linear``) where vLLM's invariant mode calls its own: vLLM's runs one
fixed 128x128 tile for every row count, so a decode step's skinny matmuls use a fraction of each tile
and, for narrow weights, a fraction of the SMs.

Only a server whose MoE backend is kittens changes: ``install`` runs when the first kittens MoE
layer is built (in each worker, before any forward pass or compilation), so stock servers with
``VLLM_BATCH_INVARIANT=1`` stay stock and comparable.
"""

import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform

from mok_serve.kernels import invariant_linear

logger = init_logger("vllm.mok_serve")

# The modules that call vLLM's invariant dense layer by a name bound at their import: each gets
# kittens' in its place (the determinism module itself too, for callers that import it lazily).
LINEAR_CALLERS = (
    "vllm.model_executor.determinism.batch_invariant",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)

_installed = False


def kittens_linear_batch_invariant(input, weight, bias=None):
    """vLLM's ``linear_batch_invariant(input, weight, bias)`` contract (weight ``[N, K]``; a bias may
    be broadcastable to ``[N]``) through ``invariant_linear``."""
    if bias is not None:
        bias = bias.expand(weight.shape[0])
    return invariant_linear(input, weight, bias)


def wanted() -> bool:
    """Whether this process serves in batch-invariant mode on CUDA, where kittens' kernels apply."""
    return bool(envs.VLLM_BATCH_INVARIANT) and current_platform.is_cuda()


def install() -> bool:
    """Put kittens' invariant dense layer in vLLM's invariant mode, once per process, when
    ``wanted()``; returns whether it is installed."""
    global _installed
    if _installed or not wanted():
        return _installed
    import importlib

    for name in LINEAR_CALLERS:
        module = importlib.import_module(name)
        if not hasattr(module, "linear_batch_invariant"):
            raise RuntimeError(f"kittens: {name} has no linear_batch_invariant (vLLM version not supported)")
        module.linear_batch_invariant = kittens_linear_batch_invariant
    _installed = True
    logger.info_once("kittens: deterministic serving: dense layers run mok-serve's batch-invariant GEMM")
    return True
