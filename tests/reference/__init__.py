"""Slow loop references of the vectorised kernels."""
