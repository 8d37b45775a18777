"""Whether this Python has the project's requirements: checked before a command imports any of them.

Run by a Python without them (the system `python3` instead of the project's `.venv`), a command
would stop at its first `import torch` or `import diffusers` with a traceback that names one module
and not the cause. Every command checks here first (the scripts in their `__main__` block, the
`python -m distill...` modules in distill/__init__.py) and says which Python lacks what, and the
command line that runs in the virtual environment `make demo` builds. Only the standard library is
imported here, so the check itself runs anywhere.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from distill.ops.errors import DistillError, Stage, report

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"

# The modules every command imports, by the name requirements.txt installs them under.
REQUIRED_MODULES = {
    "torch": "torch",
    "diffusers": "diffusers",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "huggingface_hub": "huggingface_hub",
    "yaml": "pyyaml",
    "imageio": "imageio",
}


def missing_requirements() -> list[str]:
    """The requirements (requirements.txt names) this Python cannot import, in a stable order."""
    return [
        package for module, package in REQUIRED_MODULES.items() if importlib.util.find_spec(module) is None
    ]


def requirements_error(missing: Sequence[str], command: Sequence[str]) -> DistillError:
    """The banner for a Python that lacks `missing`, with `command` (the argv that ran, the script
    or `-m module` first) rewritten to run in the project's virtual environment."""
    venv = VENV_PYTHON if VENV_PYTHON.exists() else Path(".venv/bin/python")
    rerun = shlex.join([str(venv), *command])
    fixes = (
        [f"run it with the project's virtual environment (make demo builds it): {rerun}"]
        if VENV_PYTHON.exists()
        else [
            f"build the project's virtual environment: make demo (or make test) in {REPO} creates .venv "
            f"and installs requirements.txt; then run {rerun}"
        ]
    )
    fixes.append(
        f"or install the requirements into this Python: {sys.executable} -m pip install -r {REPO / 'requirements.txt'}"
    )
    return DistillError(
        f"this Python lacks the project's requirements ({', '.join(missing)})",
        f"{sys.executable} cannot import {', '.join(missing)}: the commands run in the project's "
        "virtual environment, which has them.",
        fixes=fixes,
        stage=Stage.SETUP,
    )


def require_installed(command: Sequence[str] | None = None) -> None:
    """Exit with the banner (exit code 4) when this Python lacks a requirement; `command` is what
    ran (default: this process's own command line)."""
    missing = missing_requirements()
    if missing:
        raise SystemExit(
            report(requirements_error(missing, command if command is not None else own_command()))
        )


def own_command() -> list[str]:
    """This process's command line after the interpreter and its options: `-m module` and its
    arguments, or the script and its arguments."""
    original = list(getattr(sys, "orig_argv", []))
    if "-m" in original:
        return original[original.index("-m") :]
    return list(sys.argv)


def running_a_module() -> bool:
    """Whether `python -m distill...` is importing the package to run one of its modules: while
    Python locates the module, sys.argv[0] is "-m" (documented with the -m option)."""
    return sys.argv[:1] == ["-m"]
