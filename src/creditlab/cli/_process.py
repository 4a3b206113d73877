"""Process-wide settings of the ``creditlab`` command (the edge: the library itself never sets them).

**Huge pages for large tensors.** PyTorch's CPU allocator takes every tensor from fresh pages of
the kernel and gives them back when the tensor dies, so the next tensor of that size faults every
4 KiB page in again, and the kernel zeroes each one. The lab engines allocate tensors of tens to
hundreds of MB per operation (activations of ``M x B x L`` tokens): a copy of a 151 MB tensor took
145 ms, 37 000 page faults, of which the copy itself is about a fifth. PyTorch's own switch
``THP_MEM_ALLOC_ENABLE=1`` aligns allocations of 2 MB and more to 2 MB and asks the kernel for
transparent huge pages there (``madvise``), 512 times fewer faults: the same copy took 37 ms
(one thread, this project's 2-core CI machine kind). PyTorch reads the variable once, at its first
large allocation, and worker processes inherit it, so :func:`use_huge_pages` runs before the command
imports PyTorch. Nothing changes a number. A value the user set (e.g. ``THP_MEM_ALLOC_ENABLE=0``)
is kept.
"""

from __future__ import annotations

import os

__all__ = ["use_huge_pages"]


def use_huge_pages() -> None:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for this process and the ones it starts, unless the user set it
    (see module doc); call it before PyTorch allocates its first large tensor."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
