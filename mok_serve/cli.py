"""``mok-serve``: vLLM's OpenAI-compatible server with the kittens MoE backend (``HELP`` says how
it differs from ``vllm serve``). ``mok-serve --help`` is answered without importing vLLM; every
other invocation builds vLLM's own ``vllm serve`` parser with mok-serve's options added first.
"""

import argparse
import atexit
import logging
import os
import sys
import threading

from mok_serve import tiny_models

USAGE = ("mok-serve [MODEL] [mok-serve and vllm serve options]  |  mok-serve build-tiny [--family F]  |  "
         "mok-serve build-model --shape S")
HELP = f"""\
vLLM's OpenAI-compatible server (vllm serve) with the kittens MoE backend. Every vllm serve option
is accepted; what differs:
  --moe-backend   defaults to kittens (--moe-backend auto: vLLM's own choice)
  --host          defaults to 127.0.0.1
  MODEL           optional: without it, the embedded tiny random-weight MoE model is built
                  (offline, deterministic, cached under ~/.cache/mok-serve) and served under
                  the name tiny-FAMILY, e.g. tiny-{tiny_models.DEFAULT_FAMILY}
Per-layer MoE timing and expert load, for any --moe-backend, are on by default: GET
/v1/kittens/layers (JSON), /metrics (Prometheus, kittens:* series) and the page /kittens.
--deterministic serves every request's tokens and logprobs bitwise independent of the other
requests in its steps (vLLM's batch-invariant mode, VLLM_BATCH_INVARIANT=1, with kittens' invariant
experts, dense layers, norms and attention; CUDA only).

  mok-serve build-tiny [--family F]   build a tiny model and print its path (--list: families)
  mok-serve build-model --shape S     write a real-shape model without weights, to serve with
                                      --load-format dummy on a GPU (--list: shapes)
"""
VLLM_OPTIONS_HELP = """\
vllm serve options: every one is accepted (they load vLLM, a few seconds):
  mok-serve --help=all        all of them
  mok-serve --help=GROUP      one group, e.g. --help=ModelConfig or --help=mok-serve
  mok-serve --help=WORD       the options whose names contain WORD, e.g. --help=max-model
"""


# On a CPU, vLLM warns in every process that the installed Triton (a GPU build that xgrammar
# requires) has no CPU backend, that triton-cpu is expected, and that the V1 model runner is used
# for want of it; neither kittens nor stock CPU MoE uses Triton, and the user can do nothing
# about it. (logger, message start) pairs:
VLLM_TRITON_CPU_NOTICES = (
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
)


def _drop_vllm_triton_cpu_notices() -> None:
    for name, start in VLLM_TRITON_CPU_NOTICES:
        logging.getLogger(name).addFilter(lambda record, start=start: not str(record.msg).startswith(start))


# At import, not in main(): vLLM starts its engine and worker processes with multiprocessing's
# spawn, which imports this module (the parent's main module) in each child before vLLM.
_drop_vllm_triton_cpu_notices()


def add_mok_options(parser) -> None:
    """mok-serve's own options (on the quick help's parser and on vLLM's full one alike)."""
    group = parser.add_argument_group("mok-serve", "options mok-serve adds to vllm serve")
    group.add_argument(
        "--tiny-family",
        choices=sorted(tiny_models.FAMILIES),
        default=tiny_models.DEFAULT_FAMILY,
        help="with no MODEL, serve the embedded tiny model of this family",
    )
    group.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant serving: a request's output (token ids and logprobs) is bitwise the same "
        "whatever else shares its steps; sets VLLM_BATCH_INVARIANT=1 for every vLLM process, with kittens' "
        "invariant experts, dense layers, norms and attention where --moe-backend is kittens (CUDA only)",
    )
    group.add_argument(
        "--kittens-timing",
        type=int,
        default=1,
        metavar="N",
        help="per-layer MoE timing: sample every N-th call of each MoE layer; 0 = off, and the MoE path "
        "is then exactly the stock one",
    )
    group.add_argument(
        "--kittens-timing-window",
        type=int,
        default=1024,
        metavar="W",
        help="latency statistics over the last W sampled calls per layer",
    )


def quick_help() -> str:
    """``mok-serve --help``: mok-serve's options first, then how to list vLLM's; no vLLM import."""
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """The texts as written, each option's default after its help (as vLLM's parser shows them)."""

    parser = argparse.ArgumentParser(
        prog="mok-serve", usage=USAGE, description=HELP, epilog=VLLM_OPTIONS_HELP, add_help=False,
        formatter_class=Formatter,
    )  # fmt: skip
    add_mok_options(parser)
    return parser.format_help()


def build_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="mok-serve", usage=USAGE, description=HELP)
    add_mok_options(parser)  # first, so --help=all lists mok-serve's options before vLLM's
    parser = make_arg_parser(parser)
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


def _given(argv: list[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in argv)


def _bind_cpu_threads(args) -> None:
    """vLLM's CPU workers bind their OpenMP threads one NUMA node each and refuse to start when
    there are more workers than nodes (a 2-core VM has one); split this process's CPUs instead.
    vLLM reads one CPU list per local worker, data-parallel ranks first ([DP, PP, TP]); with fewer
    CPUs than workers, workers share CPUs in turn (a tiny model on a small VM)."""
    from vllm.platforms import current_platform

    per_rank = args.tensor_parallel_size * args.pipeline_parallel_size
    if not current_platform.is_cpu() or per_rank < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    workers = per_rank * (getattr(args, "data_parallel_size_local", None) or args.data_parallel_size)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= workers:
        per_worker = len(cpus) // workers
        chunks = [cpus[i * per_worker : (i + 1) * per_worker] for i in range(workers)]
    else:
        chunks = [[cpus[i % len(cpus)]] for i in range(workers)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, c)) for c in chunks)


def _build_cpu_kernel(args) -> None:
    """Build kittens' C++ CPU kernel here, once, before vLLM starts its workers: otherwise the
    first forward pass of every worker waits for the compiler (about 15 s on first use)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and args.moe_backend == "kittens":
        from mok_serve.kernels.cpu import moe as cpu_moe

        # Loading the cached kernel takes a fraction of a second; only a build is worth a line
        # (printed: vLLM has not configured its log handlers yet in this process).
        notice = threading.Timer(
            1.0, print, ("mok-serve: compiling kittens' CPU kernel (first start on this machine or after an update, "
                         "about 15 s)",), dict(file=sys.stderr, flush=True),
        )  # fmt: skip
        notice.start()
        try:
            cpu_moe.available()
        finally:
            notice.cancel()


def _exit_without_teardown(code: int) -> None:
    """End the process once the server has shut down: exit handlers run, the interpreter's
    teardown does not. vLLM keeps Triton objects alive to the end, so the teardown makes Triton's
    bindings (nanobind) print ~30 lines of "leaked" warnings at every exit, plain `vllm serve`
    too; a server that has shut down has nothing else to tear down."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _deterministic() -> None:
    """``--deterministic``: vLLM's batch-invariant mode for this process and the engine and worker
    processes it starts, set before vLLM reads its environment (the plugin adds kittens' kernels)."""
    if os.environ.get("VLLM_BATCH_INVARIANT", "1") not in ("", "1"):
        raise SystemExit("mok-serve: --deterministic contradicts VLLM_BATCH_INVARIANT="
                         f"{os.environ['VLLM_BATCH_INVARIANT']} in the environment")
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise SystemExit("mok-serve: --deterministic needs a CUDA GPU: vLLM's batch-invariant mode, which it "
                         f"builds on, covers CUDA devices (this machine: {current_platform.device_type or 'no GPU'})")


def serve(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    deterministic = "--deterministic" in argv
    if deterministic:
        _deterministic()  # before vLLM builds its parser and configs
    cli_env_setup()
    _allow_plugins()
    args = build_parser().parse_args(argv)
    if args.deterministic and not deterministic:  # an abbreviation of the option
        _deterministic()
    if args.model_tag is None and not _given(argv, "--model"):
        family = args.tiny_family
        args.model = str(tiny_models.build_tiny_model(family))
        # The cache path carries a content hash; clients address the model by a stable name.
        args.served_model_name = args.served_model_name or [tiny_models.served_name(family)]
        # vLLM's CPU backend otherwise reserves 92% of the memory for the KV cache and refuses to
        # start when other processes hold more than 8%; 1 GiB is plenty for the tiny model.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    elif _given(argv, "--tiny-family"):
        raise SystemExit("mok-serve: --tiny-family applies only when no model is given")
    validate_parsed_serve_args(args)
    _configure_timing(args)
    _bind_cpu_threads(args)
    _build_cpu_kernel(args)
    ServeSubcommand.cmd(args)
    _exit_without_teardown(0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-tiny"]:
        return tiny_models.main(argv[1:])
    if argv[:1] == ["build-model"]:
        from mok_serve import shaped_models

        return shaped_models.main(argv[1:])
    if "-h" in argv or "--help" in argv:
        print(quick_help(), end="")
        return 0
    serve(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
