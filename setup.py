"""Everything is declared in pyproject.toml; this file adds one build step that pyproject.toml
cannot express: a ``.pth`` file installed beside the package (``mok_serve/vllm_cpu_alias.py``
says why), in regular and editable installs alike."""

import os

from setuptools import Command, setup
from setuptools.command.build import build

PTH_NAME = "mok_serve_vllm_cpu_alias.pth"
PTH_LINE = "import mok_serve.vllm_cpu_alias; mok_serve.vllm_cpu_alias.install()\n"


class BuildPth(Command):
    """Write the .pth file into the wheel's root (site-packages once installed)."""

    description = f"write {PTH_NAME}"
    user_options = []
    editable_mode = False  # set by setuptools' editable_wheel

    def initialize_options(self):
        self.build_lib = None

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _target_dir(self) -> str:
        # An editable wheel holds no build_lib files, only what is installed into its root
        # (install_lib there); a regular wheel is build_lib.
        return self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib

    def run(self):
        os.makedirs(self._target_dir(), exist_ok=True)
        with open(os.path.join(self._target_dir(), PTH_NAME), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self):
        return [] if self.editable_mode else [os.path.join(self.build_lib, PTH_NAME)]


build.sub_commands.append(("build_pth", None))
setup(cmdclass={"build_pth": BuildPth})
