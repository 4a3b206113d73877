"""Loop references for creditlab.integrations._common.turn_layout and the verl reward layout."""

from __future__ import annotations


def ref_turns(mask_row: list[bool]) -> list[list[int]]:
    """Token positions of each turn (maximal run of True) of one row."""
    turns, cur = [], []
    for i, m in enumerate(mask_row):
        if m:
            cur.append(i)
        elif cur:
            turns.append(cur)
            cur = []
    if cur:
        turns.append(cur)
    return turns


def ref_span_sums(mask_row: list[bool], values: list[float]) -> list[float]:
    """Sum of values from each turn's first token up to the next turn's first token (turn 0 also takes
    the positions before it)."""
    turns = ref_turns(mask_row)
    if not turns:
        return [sum(values)]
    starts = [t[0] for t in turns] + [len(values)]
    out = []
    for k in range(len(turns)):
        lo = 0 if k == 0 else starts[k]
        out.append(sum(values[lo:starts[k + 1]]))
    return out


def ref_prm_split(mask_row: list[bool], values: list[float]) -> tuple[float, list[float]]:
    """(outcome, process scores): the outcome is everything from the last policy token on; process
    score k is the sum over turn k's span before that token."""
    turns = ref_turns(mask_row)
    if not turns:
        return sum(values), [0.0]
    last = turns[-1][-1]
    outcome = sum(values[last:])
    head = list(values[:last]) + [0.0] * (len(values) - last)
    return outcome, ref_span_sums(mask_row, head)


def ref_to_tokens(mask_row: list[bool], step_values: list[float]) -> list[float]:
    out = [0.0] * len(mask_row)
    for k, turn in enumerate(ref_turns(mask_row)):
        for i in turn:
            out[i] = step_values[k]
    return out
