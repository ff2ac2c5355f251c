"""``mok-serve``: vLLM's OpenAI-compatible server with the kittens MoE backend.

    mok-serve [MODEL] [any `vllm serve` option ...]
    mok-serve build-tiny [--family F] [--list]

Every `vllm serve` option passes through. Differences from `vllm serve`: ``--moe-backend``
defaults to ``kittens``, ``--host`` to 127.0.0.1, and with no model the embedded tiny MoE model
is built (offline, deterministic, cached) and served; ``--tiny-family`` picks another family.

Per-layer MoE timing and expert load (any ``--moe-backend``) are on by default:
``--kittens-timing N`` times every N-th call of each MoE layer (0 turns timing off: the MoE path
is then exactly the stock one), ``--kittens-timing-window W`` keeps the last W sampled calls.
They are served at ``GET /v1/kittens/layers``, ``/metrics`` and the page ``/kittens`` (the
``kittens`` endpoint plugin, enabled through ``VLLM_PLUGINS``; the worker extension
``mok_serve.vllm.timing.KittensWorkerExtension`` is the default ``--worker-extension-cls``).
"""

import os
import sys

from mok_serve import tiny_models


def build_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="mok-serve",
        usage="mok-serve [MODEL] [vllm serve options]  |  mok-serve build-tiny [--family F]",
        description=__doc__,
    )
    parser = make_arg_parser(parser)
    parser.add_argument(
        "--tiny-family",
        choices=sorted(tiny_models.FAMILIES),
        default=None,
        help=f"with no model given, serve the embedded tiny model of this family "
        f"(default {tiny_models.DEFAULT_FAMILY})",
    )
    parser.add_argument(
        "--kittens-timing",
        type=int,
        default=1,
        metavar="N",
        help="per-layer MoE timing: sample every N-th call of each MoE layer; 0 = off (default 1)",
    )
    parser.add_argument(
        "--kittens-timing-window",
        type=int,
        default=1024,
        metavar="W",
        help="latency statistics over the last W sampled calls per layer (default 1024)",
    )
    parser.set_defaults(moe_backend="kittens", host="127.0.0.1")
    return parser


ENDPOINT_PLUGIN = "kittens"  # the vllm.endpoint_plugins entry point (and the general plugin's name)
WORKER_EXTENSION = "mok_serve.vllm.timing.KittensWorkerExtension"


def _allow_plugins() -> None:
    """Endpoint plugins load only when named in ``VLLM_PLUGINS``, which is also the allowlist of
    every other plugin group: keep every discovered plugin allowed and add ours."""
    from importlib.metadata import entry_points

    if "VLLM_PLUGINS" in os.environ:
        names = [n for n in os.environ["VLLM_PLUGINS"].split(",") if n]
    else:
        eps = entry_points()
        groups = [g for g in eps.groups if g.startswith("vllm.") and g != "vllm.endpoint_plugins"]
        names = sorted({ep.name for g in groups for ep in eps.select(group=g)})
    if ENDPOINT_PLUGIN not in names:
        names.append(ENDPOINT_PLUGIN)
    os.environ["VLLM_PLUGINS"] = ",".join(names)


def _configure_timing(args) -> None:
    from mok_serve.vllm.timing import CONFIG_KEY

    if args.kittens_timing < 0 or args.kittens_timing_window < 1:
        raise SystemExit("mok-serve: --kittens-timing must be >= 0 and --kittens-timing-window >= 1")
    extra = dict(args.additional_config or {})
    if CONFIG_KEY not in extra:
        extra[CONFIG_KEY] = {"sample_every": args.kittens_timing, "window": args.kittens_timing_window}
    args.additional_config = extra
    if not args.worker_extension_cls:
        args.worker_extension_cls = WORKER_EXTENSION


def _model_given(argv: list[str], args) -> bool:
    return args.model_tag is not None or any(a == "--model" or a.startswith("--model=") for a in argv)


def _bind_cpu_threads(args) -> None:
    """vLLM's CPU workers bind their OpenMP threads one NUMA node each and refuse to start when
    there are more workers than nodes (a 2-core VM has one); split this process's CPUs instead."""
    from vllm.platforms import current_platform

    workers = args.tensor_parallel_size * args.pipeline_parallel_size
    if not current_platform.is_cpu() or workers < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < workers:
        raise SystemExit(f"mok-serve: {workers} CPU workers need at least {workers} CPUs; {len(cpus)} available")
    per_worker = len(cpus) // workers
    chunks = [cpus[i * per_worker : (i + 1) * per_worker] for i in range(workers)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in chunks)


def _build_cpu_kernel(args) -> None:
    """Build kittens' C++ CPU kernel here, once, before vLLM starts its workers: otherwise the
    first forward pass of every worker waits for the compiler (about 15 s on first use)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and args.moe_backend == "kittens":
        from mok_serve.kernels import cpu_moe

        # vLLM has not configured its log handlers yet in this process.
        print("mok-serve: loading kittens' CPU kernel (compiled on first use, about 15 s)", file=sys.stderr, flush=True)
        cpu_moe.available()


def serve(argv: list[str]) -> int:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    _allow_plugins()
    args = build_parser().parse_args(argv)
    if not _model_given(argv, args):
        family = args.tiny_family or tiny_models.DEFAULT_FAMILY
        args.model = str(tiny_models.build_tiny_model(family))
        # vLLM's CPU backend otherwise reserves 92% of the memory for the KV cache and refuses to
        # start when other processes hold more than 8%; 1 GiB is plenty for the tiny model.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    elif args.tiny_family:
        raise SystemExit("mok-serve: --tiny-family applies only when no model is given")
    validate_parsed_serve_args(args)
    _configure_timing(args)
    _bind_cpu_threads(args)
    _build_cpu_kernel(args)
    ServeSubcommand.cmd(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-tiny"]:
        return tiny_models.main(argv[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
