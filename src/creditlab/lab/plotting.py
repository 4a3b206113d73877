"""Figures without pyplot: no backend is selected and no global matplotlib state is touched.

``matplotlib.figure.Figure`` renders to PNG through the Agg canvas by itself, so labs can draw
from any thread or process without ``matplotlib.use`` (a process-wide setting a library must not
change) and without closing figures.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

__all__ = ["new_figure", "save"]


def new_figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] = (7, 4.2), **subplots_kw):
    """``(fig, axes)`` like ``pyplot.subplots`` (``axes`` is one Axes for a 1x1 grid)."""
    layout = subplots_kw.pop("layout", "constrained")
    fig = Figure(figsize=figsize, layout=layout)
    axes = fig.subplots(nrows, ncols, **subplots_kw)
    return fig, axes


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG to ``path`` and return the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
