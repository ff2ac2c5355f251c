"""The one place the kernels read the environment, always at call time (never at import time).

Every knob is a keyword argument of the launcher or method that uses it; left at ``None`` it takes
its value from ``knob(name)``, which reads the variable below when the call is made:

===================  ==========================  ========  ============================================
knob                 variable                    default   meaning
===================  ==========================  ========  ============================================
``interpret``        ``TRITON_INTERPRET``        ``0``     Triton kernels run under the interpreter
``pdl``              ``MOK_PDL``                 ``1``     programmatic dependent launch (Hopper+)
``one_launch``       ``MOK_DECODE_ONE_LAUNCH``   ``1``     both GEMMs as one launch at decode sizes
``ep_timeout_s``     ``MOK_EP_TIMEOUT_S``        ``120``   EP: seconds to wait for a peer
``ep_return_mode``   ``MOK_EP_RETURN``           ``pull``  EP (CUDA): how expert outputs come back
``ep_pull_in_gemm1`` ``MOK_EP_PULL_IN_GEMM1``    ``0``     EP (CUDA): GEMM1 pulls its token rows
``ep_sync_check``    ``MOK_EP_SYNC_CHECK``       ``0``     EP: check id values on the host (syncs)
``ep_node_size``     ``MOK_EP_NODE_SIZE``        ``0``     EP: ranks per node (0: ranks on one host)
``cpu_isa``          ``MOK_SERVE_CPU_ISA``       ``auto``  C++ kernel's instruction set
===================  ==========================  ========  ============================================
"""

import os

__all__ = ["KNOBS", "knob"]


def _flag(value: str) -> bool:
    return value not in ("", "0")


# knob -> (environment variable, default text, parser)
KNOBS = {
    "interpret": ("TRITON_INTERPRET", "0", _flag),
    "pdl": ("MOK_PDL", "1", _flag),
    "one_launch": ("MOK_DECODE_ONE_LAUNCH", "1", _flag),
    "ep_timeout_s": ("MOK_EP_TIMEOUT_S", "120", float),
    "ep_return_mode": ("MOK_EP_RETURN", "pull", str),
    "ep_pull_in_gemm1": ("MOK_EP_PULL_IN_GEMM1", "0", _flag),
    "ep_sync_check": ("MOK_EP_SYNC_CHECK", "0", _flag),
    "ep_node_size": ("MOK_EP_NODE_SIZE", "0", int),
    "cpu_isa": ("MOK_SERVE_CPU_ISA", "auto", lambda v: v or "auto"),
}


def knob(name: str, value=None):
    """``value`` when given (a caller's explicit argument), else knob ``name`` read from the
    environment now (its variable, or the default when unset)."""
    if value is not None:
        return value
    variable, default, parse = KNOBS[name]
    return parse(os.environ.get(variable, default))
