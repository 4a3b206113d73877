"""Segments of policy tokens: ids, lengths and turn indices, without Python loops over tokens.

A *segment* is a maximal run of consecutive policy tokens inside one trajectory (one action, one
turn of an agent). Prompt, tool/observation tokens and padding separate segments; a segment never
crosses rows. Segments are numbered row-major over the whole batch (flat id ``0..S-1``), which is
the index that ``index_add_`` / ``scatter`` use for per-segment statistics.

Shapes: ``B`` trajectories, ``L`` tokens, ``S`` segments in the whole batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from creditlab.core._checks import check_tensor, require_values
from creditlab.errors import InputError

__all__ = [
    "SegmentBounds",
    "Segments",
    "effective_policy_mask",
    "segment_bounds",
    "segment_sum",
    "segments",
    "segments_from_bounds",
]


class SegmentBounds(NamedTuple):
    """Where the segments of a batch start and end (cheap: no ``(B, L)`` id maps).

    Attributes:
        policy: ``(B, L)`` bool, ``policy_mask & valid_mask``.
        starts: ``(B, L)`` bool, True on the first token of each segment.
        start: ``(S,)`` int64 flat index (``b * L + t``) of each segment's first token.
        end: ``(S,)`` int64 flat index of each segment's last token (inclusive).
        row: ``(S,)`` int64 row of each segment.
        turn: ``(S,)`` int64 turn index of each segment within its row.
        n_segments: ``(B,)`` int64 number of segments per row.
        num_segments: ``S`` as a Python int.
    """

    policy: torch.Tensor
    starts: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    row: torch.Tensor
    turn: torch.Tensor
    n_segments: torch.Tensor
    num_segments: int


class Segments(NamedTuple):
    """Segment structure of a batch.

    Attributes:
        policy: ``(B, L)`` bool, ``policy_mask & valid_mask``: the tokens that belong to a segment.
        seg_id: ``(B, L)`` int64 flat segment id in ``[0, S)`` on policy tokens, ``-1`` elsewhere.
        turn_index: ``(B, L)`` int64 index of the token's segment within its row (0 = first
            action of the trajectory), ``-1`` on non-policy tokens.
        lengths: ``(S,)`` int64 number of tokens of each segment (>= 1).
        row: ``(S,)`` int64 row (trajectory) of each segment.
        turn: ``(S,)`` int64 turn index of each segment within its row.
        n_segments: ``(B,)`` int64 number of segments per row.
        num_segments: ``S`` as a Python int.
    """

    policy: torch.Tensor
    seg_id: torch.Tensor
    turn_index: torch.Tensor
    lengths: torch.Tensor
    row: torch.Tensor
    turn: torch.Tensor
    n_segments: torch.Tensor
    num_segments: int


def effective_policy_mask(policy_mask: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``policy_mask & valid_mask`` after checking both are ``(B, L)`` bool tensors."""
    dims: dict[str, int] = {}
    check_tensor("policy_mask", policy_mask, shape=("B", "L"), boolean=True, dims=dims)
    if valid_mask is None:
        return policy_mask
    check_tensor("valid_mask", valid_mask, shape=("B", "L"), boolean=True, dims=dims)
    if valid_mask.device != policy_mask.device:
        _raise_device("valid_mask", valid_mask, policy_mask)
    return policy_mask & valid_mask


def _raise_device(name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
    raise InputError(f"{name}: is on device {x.device} but the other inputs are on {ref.device}")


def segment_bounds(policy_mask: torch.Tensor, valid_mask: torch.Tensor | None = None) -> SegmentBounds:
    """First and last flat token index of every segment, its row and turn; ``(S,)`` each.

    A segment starts at a policy token whose left neighbour in the same row is not a policy
    token and ends at one whose right neighbour is not. Only boolean ``&``/``~`` passes and one
    ``nonzero`` over ``(B, L)`` (one host synchronisation reads ``S``).

    >>> b = segment_bounds(torch.tensor([[True, True, False, True], [False, False, True, True]]))
    >>> b.start.tolist(), b.end.tolist(), b.row.tolist(), b.turn.tolist(), b.n_segments.tolist()
    ([0, 3, 6], [1, 3, 7], [0, 0, 1], [0, 1, 0], [2, 1])
    """
    require_values("segment_bounds", "the segment count comes from the data (nonzero)", policy_mask, valid_mask)
    return _bounds_of_effective_mask(effective_policy_mask(policy_mask, valid_mask))


def _starts_ends(pm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, L)`` bool first and last tokens of the segments of an effective policy mask (boolean passes only)."""
    starts, ends = pm.clone(), pm.clone()
    if pm.shape[1] > 1:
        starts[:, 1:] &= ~pm[:, :-1]
        ends[:, :-1] &= ~pm[:, 1:]
    return starts, ends


def _bounds_of_effective_mask(pm: torch.Tensor) -> SegmentBounds:
    """:func:`segment_bounds` of an already-effective ``(B, L)`` mask (no check, no valid mask); the per-row
    counts from the segment rows (``(S,)`` work) instead of a ``(B, L)`` sum."""
    B, L = pm.shape
    starts, ends = _starts_ends(pm)
    # one nonzero over a 2-bit code (1: first token, 2: last token, 3: one-token segment)
    code = (starts.view(torch.uint8) + ends.view(torch.uint8) * 2).reshape(-1)
    pos = code.nonzero().squeeze(1)
    kind = code[pos]
    start = pos[(kind & 1) > 0]
    end = pos[kind >= 2]
    S = start.numel()
    row = torch.div(start, max(L, 1), rounding_mode="floor")
    n_segments = torch.zeros(B, dtype=torch.int64, device=pm.device).index_add_(0, row, torch.ones_like(row))
    offsets = torch.cumsum(n_segments, 0) - n_segments  # (B,) flat id of each row's first segment
    turn = torch.arange(S, device=pm.device) - offsets[row]
    return SegmentBounds(pm, starts, start, end, row, turn, n_segments, S)


def segments(policy_mask: torch.Tensor, valid_mask: torch.Tensor | None = None) -> Segments:
    """Segment ids, lengths, turn indices and per-row counts of a ``(B, L)`` policy mask.

    The flat id of a policy token is the running count of segment starts over the flattened
    batch minus one; its turn index is the running count within its row minus one (computed with
    integer arithmetic, no ``where`` over ``(B, L)``).

    >>> pm = torch.tensor([[True, True, False, True], [False, False, False, False],
    ...                    [True, False, True, True]])
    >>> seg = segments(pm)
    >>> seg.seg_id
    tensor([[ 0,  0, -1,  1],
            [-1, -1, -1, -1],
            [ 2, -1,  3,  3]])
    >>> seg.lengths.tolist(), seg.row.tolist(), seg.turn.tolist(), seg.n_segments.tolist()
    ([2, 1, 1, 2], [0, 0, 2, 2], [0, 1, 0, 1], [2, 0, 2])
    """
    require_values("segments", "the segment count comes from the data (nonzero)", policy_mask, valid_mask)
    return segments_from_bounds(segment_bounds(policy_mask, valid_mask))


def segments_from_bounds(b: SegmentBounds) -> Segments:
    """The :class:`Segments` of a batch whose :class:`SegmentBounds` are already known (no second
    ``nonzero`` / host synchronisation)."""
    B, L = b.policy.shape
    on = b.policy.view(torch.uint8).to(torch.int64)  # (B, L) 1 on policy tokens
    st = b.starts.view(torch.uint8)
    seg_id = torch.cumsum(st.reshape(-1), 0).view(B, L).mul_(on).sub_(1)
    turn_index = torch.cumsum(st, dim=1).mul_(on).sub_(1)
    lengths = b.end - b.start + 1
    return Segments(b.policy, seg_id, turn_index, lengths, b.row, b.turn, b.n_segments, b.num_segments)


def segment_sum(values: torch.Tensor, seg_id: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment sum ``(S,)`` of ``(B, L)`` ``values`` (tokens with ``seg_id == -1`` are ignored).

    Non-policy tokens are sent to a spare bin ``S`` that is dropped, so no boolean compaction
    (and no extra synchronisation) is needed. Junk (even NaN) at non-policy tokens is zeroed
    first. The result has the dtype of ``values``.
    """
    idx = seg_id.reshape(-1)
    idx = torch.where(idx < 0, torch.full_like(idx, num_segments), idx)
    vals = values.reshape(-1)
    if vals.is_floating_point():
        vals = torch.where(idx < num_segments, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
    out = torch.zeros(num_segments + 1, dtype=values.dtype, device=values.device)
    out.index_add_(0, idx, vals)
    return out[:num_segments]
