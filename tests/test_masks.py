"""Segments of policy tokens: vectorised ``segments`` against the loop reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core.masks import segment_bounds, segment_sum, segments
from creditlab.errors import InputError
from reference.ref_correction import ref_seg_ids, ref_segments


def _compare(pm: torch.Tensor) -> None:
    b = segment_bounds(pm)
    L = pm.shape[1]
    flat = [(row * L + s, row * L + e - 1, turn) for row, segs in enumerate(ref_segments(pm.tolist()))
            for s, e, turn in segs]
    assert b.start.tolist() == [f[0] for f in flat]
    assert b.end.tolist() == [f[1] for f in flat]
    assert b.turn.tolist() == [f[2] for f in flat]
    seg = segments(pm)
    seg_id, turn_index, lengths, rows, turns, n_segments = ref_seg_ids(pm.tolist())
    assert seg.seg_id.tolist() == seg_id
    assert seg.turn_index.tolist() == turn_index
    assert seg.lengths.tolist() == lengths
    assert seg.row.tolist() == rows
    assert seg.turn.tolist() == turns
    assert seg.n_segments.tolist() == n_segments
    assert seg.num_segments == len(lengths)


def test_golden_small_batch():
    pm = torch.tensor([
        [False, True, True, False, False, True, False, True],  # prompt, action, tool, action, tool, action
        [False, False, False, False, False, False, False, False],  # no policy token
        [True, True, True, True, True, True, True, True],  # one segment filling the row
    ])
    seg = segments(pm)
    assert seg.seg_id.tolist() == [
        [-1, 0, 0, -1, -1, 1, -1, 2],
        [-1] * 8,
        [3] * 8,
    ]
    assert seg.turn_index[0].tolist() == [-1, 0, 0, -1, -1, 1, -1, 2]
    assert seg.lengths.tolist() == [2, 1, 1, 8]
    assert seg.row.tolist() == [0, 0, 0, 2]
    assert seg.turn.tolist() == [0, 1, 2, 0]
    assert seg.n_segments.tolist() == [3, 0, 1]


def test_segments_never_cross_rows():
    # row 0 ends with a policy token and row 1 starts with one: two different segments
    pm = torch.tensor([[False, True], [True, False]])
    seg = segments(pm)
    assert seg.seg_id.tolist() == [[-1, 0], [1, -1]]
    assert seg.turn.tolist() == [0, 0]


def test_valid_mask_cuts_policy():
    pm = torch.ones(1, 5, dtype=torch.bool)
    vm = torch.tensor([[True, True, False, True, True]])
    seg = segments(pm, vm)
    assert seg.lengths.tolist() == [2, 2]
    assert seg.policy.tolist() == vm.tolist()


def test_empty_shapes():
    seg = segments(torch.zeros(3, 0, dtype=torch.bool))
    assert seg.num_segments == 0 and seg.n_segments.tolist() == [0, 0, 0]
    seg = segments(torch.zeros(0, 4, dtype=torch.bool))
    assert seg.num_segments == 0 and seg.lengths.numel() == 0


@given(st.integers(1, 6), st.integers(1, 40), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_matches_reference_random(B, L, p, seed):
    g = torch.Generator().manual_seed(seed)
    pm = torch.rand(B, L, generator=g) < p
    _compare(pm)


def test_segment_sum_ignores_junk_off_policy():
    pm = torch.tensor([[True, False, True, True]])
    seg = segments(pm)
    vals = torch.tensor([[1.0, float("nan"), 2.0, 3.0]])
    assert segment_sum(vals, seg.seg_id, seg.num_segments).tolist() == [1.0, 5.0]


@pytest.mark.parametrize(
    "bad", [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.int64), torch.ones(3, dtype=torch.bool)]
)
def test_bad_policy_mask(bad):
    with pytest.raises(InputError, match="policy_mask"):
        segments(bad)


def test_bad_valid_mask():
    with pytest.raises(InputError, match="valid_mask"):
        segments(torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="valid_mask"):
        segments(torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3))
