"""Distil the Wan 2.2 A14B text-to-video teacher into a compact diffusers student."""

from distill.ops import requirements as _requirements

__version__ = "0.1.0"

# `python -m distill.<command>` imports this package first: the requirements are checked before the
# command's own first import of one of them (torch, diffusers), so a Python without them says so
# and how to run in the project's virtual environment, instead of a traceback.
if _requirements.running_a_module():
    _requirements.require_installed()
