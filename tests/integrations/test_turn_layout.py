"""Turn layout kernels of the trainer integrations against their loop references."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.integrations._common import turn_layout
from reference.ref_turns import ref_prm_split, ref_span_sums, ref_to_tokens, ref_turns

masks = st.integers(1, 5).flatmap(lambda B: st.integers(1, 14).flatmap(
    lambda L: st.tuples(st.lists(st.lists(st.booleans(), min_size=L, max_size=L), min_size=B, max_size=B),
                        st.integers(0, 2**31 - 1))))


@given(masks)
def test_turn_layout_matches_loop_reference(args):
    rows, seed = args
    pm = torch.tensor(rows)
    B, L = pm.shape
    values = torch.randn(B, L, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lay = turn_layout(pm)
    T = lay.num_turns
    spans = lay.span_sums(values)
    tail = lay.tail.to(values.dtype)
    prm_scores = lay.span_sums(values * (1 - tail))
    outcome = (values * tail).sum(1)
    step_values = torch.randn(B, T, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    tokens = lay.to_tokens(step_values)
    for i in range(B):
        row, v = rows[i], values[i].tolist()
        n = len(ref_turns(row))
        assert lay.step_mask[i].tolist() == [k < n for k in range(T)]
        ref = ref_span_sums(row, v)
        torch.testing.assert_close(spans[i, :len(ref)], torch.tensor(ref, dtype=torch.float64))
        assert bool((spans[i, len(ref):] == 0).all())
        ref_out, ref_proc = ref_prm_split(row, v)
        assert abs(float(outcome[i]) - ref_out) < 1e-9
        torch.testing.assert_close(prm_scores[i, :len(ref_proc)], torch.tensor(ref_proc, dtype=torch.float64))
        torch.testing.assert_close(tokens[i], torch.tensor(ref_to_tokens(row, step_values[i].tolist()),
                                                           dtype=torch.float64))


@given(masks)
def test_pack_turn_rewards_round_trips_through_the_prm_split(args):
    from creditlab.integrations.verl import pack_turn_rewards

    rows, seed = args
    pm = torch.tensor(rows)
    lay = turn_layout(pm)
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(lay.step_mask.shape, generator=g) * lay.step_mask
    outcome = torch.rand(pm.shape[0], generator=g) * pm.any(1)
    for i, row in enumerate(rows):  # a one-token final turn has no slot for a process score
        turns = ref_turns(row)
        if turns and len(turns[-1]) == 1:
            scores[i, len(turns) - 1] = 0.0
    r = pack_turn_rewards(pm.float(), outcome, scores).double()
    for i, row in enumerate(rows):
        ref_out, ref_proc = ref_prm_split(row, r[i].tolist())
        assert abs(ref_out - float(outcome[i])) < 1e-6
        n = len(ref_turns(row))
        torch.testing.assert_close(torch.tensor(ref_proc[:n], dtype=torch.float64), scores[i, :n].double(),
                                   rtol=1e-6, atol=1e-7)
