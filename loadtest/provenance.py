"""Which code a result came from: the commit, stated with every benchmark and load-test result."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """``$MOK_COMMIT`` where set (the device machines get a copy of the working tree without
    ``.git``), else ``git rev-parse HEAD`` of this checkout, with ``-dirty`` when tracked files
    differ from it; ``unknown`` outside a checkout."""
    if env := os.environ.get("MOK_COMMIT"):
        return env
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if rev.returncode != 0:
        return "unknown"
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
