"""The kernel benchmarks (``mok_serve.loadtest.bench``): they import ``mok_serve.kernels`` and time
the MoE layer itself, where the load tool above talks to servers over HTTP only.

- ``layer``: one-GPU MoE layer benchmark (``mok-loadtest layer``);
- ``ep``: expert-parallel layer benchmark, a rank per GPU (``mok-loadtest ep``); ``ep_profile``:
  device time per kernel of one EP call; ``ep_scaling``: ``ep`` runs of several EP degrees side
  by side (``mok-loadtest ep-scaling``);
- ``l2_rates``: TMA tile read rates from L2 and HBM;
- ``cpu_layer``: kittens' C++ CPU kernel against stock vLLM's CPU MoE.

Every one appends its figures to ``loadtest/results/history.csv`` (``mok_serve.loadtest.history``).
"""
