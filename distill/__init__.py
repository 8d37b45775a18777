"""Distil the Wan 2.2 A14B text-to-video teacher into a compact diffusers student."""

__version__ = "0.1.0"
