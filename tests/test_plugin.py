"""The vLLM plugin, without starting a server: registration, CLI choice, config validation."""

import importlib.metadata

import pytest

vllm = pytest.importorskip("vllm")


def test_entry_point_registered():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "kittens" and ep.value == "mok_serve.plugin:register" for ep in plugins)


def test_vllm_serve_parser_accepts_kittens():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mok_serve.plugin import register

    register()
    parser = make_arg_parser(FlexibleArgumentParser())
    assert parser.parse_args(["--moe-backend", "kittens"]).moe_backend == "kittens"
    assert parser.parse_args(["--moe-backend", "triton"]).moe_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-backend", "kitten"])


def test_kernel_config_validates_kittens():
    from vllm.config.kernel import KernelConfig

    from mok_serve.plugin import register

    register()
    assert KernelConfig(moe_backend="Kittens").moe_backend == "kittens"
    with pytest.raises(Exception, match="kitten"):
        KernelConfig(moe_backend="kitten")


def test_mok_serve_defaults():
    from mok_serve.cli import build_parser
    from mok_serve.plugin import register

    register()
    args = build_parser().parse_args([])
    assert args.moe_backend == "kittens"
    assert args.host == "127.0.0.1"
    assert build_parser().parse_args(["--moe-backend", "auto"]).moe_backend == "auto"
