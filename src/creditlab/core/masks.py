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

from creditlab.core._checks import check_tensor
from creditlab.errors import InputError

__all__ = ["Segments", "effective_policy_mask", "segments", "segment_sum"]


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


def segments(policy_mask: torch.Tensor, valid_mask: torch.Tensor | None = None) -> Segments:
    """Segment ids, lengths, turn indices and per-row counts of a ``(B, L)`` policy mask.

    A segment starts at a policy token whose left neighbour (in the same row) is not a policy
    token; the turn index of a token is the running count of starts in its row minus one, and the
    flat id adds the number of segments of all earlier rows. One host synchronisation reads ``S``.

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
    pm = effective_policy_mask(policy_mask, valid_mask)
    B, L = pm.shape
    device = pm.device
    starts = pm.clone()
    if L > 1:
        starts[:, 1:] &= ~pm[:, :-1]
    running = torch.cumsum(starts, dim=1)  # (B, L) int64: segments started so far in the row
    n_segments = running[:, -1].clone() if L > 0 else torch.zeros(B, dtype=torch.int64, device=device)
    offsets = torch.cumsum(n_segments, 0) - n_segments  # (B,) flat id of each row's first segment
    turn_index = torch.where(pm, running - 1, torch.full_like(running, -1))
    del running, starts
    seg_id = torch.where(pm, turn_index + offsets[:, None], torch.full_like(turn_index, -1))
    S = int(n_segments.sum().item())
    row = torch.repeat_interleave(torch.arange(B, device=device), n_segments, output_size=S)
    turn = torch.arange(S, device=device) - offsets[row]
    lengths = segment_sum(torch.ones((), dtype=torch.int64, device=device).expand(B, L), seg_id, S)
    return Segments(pm, seg_id, turn_index, lengths, row, turn, n_segments, S)


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
