"""Run a test scenario in N spawned rank processes of one torch.distributed group.

``scenario(rank, world)`` is a module-level function (spawned processes import it by name); it may
return a log string, printed by the parent. Backend ``"gloo"`` (CPU: one thread per rank) or
``"nccl"`` (rank r on GPU r).
"""

import multiprocessing as mp
import os
import socket
import traceback

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, backend, scenario, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            # NVLink multicast stays off in every GPU group the tests start (the lent machines' notes).
            for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                               ("NVSHMEM_DISABLE_NVLS", "1")):
                os.environ.setdefault(key, value)
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
            torch.set_num_threads(1)
        log = scenario(rank, world)
        queue.put((rank, None, log or ""))
    except BaseException:
        queue.put((rank, traceback.format_exc(), ""))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(scenario, world, backend="gloo"):
    """Start the ranks; returns (processes, queue of (rank, traceback or None, log))."""
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, backend, scenario, queue)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, queue


def run_ranks(scenario, world, *, backend="gloo", timeout=240, join_timeout=10):
    """Run ``scenario`` on every rank; fails with every failing rank's traceback. ``timeout``
    bounds the wait for each rank's result, ``join_timeout`` each rank's exit (then it is killed)."""
    procs, queue = spawn_ranks(scenario, world, backend)
    results = {}
    try:
        for _ in range(world):
            rank, error, log = queue.get(timeout=timeout)
            results[rank] = error
            if log:
                print(f"rank {rank}:\n{log}")
    finally:
        for p in procs:
            p.join(join_timeout)
            if p.is_alive():
                p.kill()
    failures = {r: e for r, e in results.items() if e}
    assert not failures, "\n".join(f"rank {r}:\n{e}" for r, e in failures.items())
