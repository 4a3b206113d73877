"""Imports every built-in lab module, which registers its lab in :data:`creditlab.lab.protocol.LABS`."""

from creditlab.lab import coverage, fork, granularity, mismatch, toolshop  # noqa: F401

__all__: list[str] = []
