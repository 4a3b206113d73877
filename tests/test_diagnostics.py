"""creditlab.core.diagnostics: goldens, enumeration references, chain length by dataflow."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core import diagnostics as d
from creditlab.errors import InputError
from reference import ref_credit as ref


def test_p_cover_golden_and_enumeration():
    assert float(d.p_cover(12, 3, 3)) == pytest.approx(1 / 220)
    assert float(d.p_cover(12, 4, 3)) == 0.0
    for T, C, k in [(6, 2, 3), (7, 3, 5), (5, 1, 1), (6, 6, 6), (8, 3, 8)]:
        assert float(d.p_cover(T, C, k)) == pytest.approx(ref.p_cover_enum(T, C, k))
    Ts = torch.tensor([12, 12, 12])
    torch.testing.assert_close(d.p_cover(Ts, torch.tensor([1, 2, 3]), 3),
                               torch.tensor([3 / 12, 3 / 66, 1 / 220], dtype=torch.float64))


@given(st.floats(0, 1), st.integers(1, 30))
def test_open_fraction_is_the_geometric_series(q, C):
    assert float(d.expected_open_fraction(q, C)) == pytest.approx(ref.open_fraction_sum(q, C), abs=1e-9)
    assert 0.0 <= float(d.expected_open_fraction(q, C)) <= 1.0


def test_verifier_density_and_mixing():
    assert float(d.verifier_density(3, 12)) == 0.25
    s, inc = d.mixing_score(torch.tensor([1, 4, 0, 0, 3]), torch.tensor([1, 0, 0, 2, 1]))
    torch.testing.assert_close(s, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5], dtype=torch.float64))
    assert inc.tolist() == [True, True, False, True, True]
    assert not torch.isnan(s).any()
    with pytest.raises(InputError):
        d.mixing_score(torch.tensor([1]), torch.tensor([1, 2]))


def test_aulc_rollback_concentration():
    sc = torch.tensor([[0.0, 0.5, 1.0, 0.4], [0.2, 0.2, 0.2, 0.2]])
    torch.testing.assert_close(d.aulc(sc), torch.tensor([0.475, 0.2]))
    torch.testing.assert_close(d.rollback(sc), torch.tensor([0.6, 0.0]))
    share, frac = d.concentration(torch.tensor([8.0, 1.0, 1.0, 0.0]), 0.25)
    assert share == pytest.approx(0.8) and frac == 0.25
    assert d.concentration(torch.zeros(3), 0.5)[0] == 0.0
    with pytest.raises(InputError, match="top_frac"):
        d.concentration(torch.ones(3), 0.0)


def call(name, args, ret, w=False):
    return {"name": name, "arguments": args, "returned": ret, "is_write": w}


def test_chain_length_by_dataflow():
    # retail-style exchange: user -> orders -> order -> product -> variants -> write
    calls = [
        call("find_user", {"email": "ann@x.com"}, {"user_id": "u3"}),
        call("get_user", {"user_id": "u3"}, {"orders": ["o1", "o2"]}),
        call("get_order", {"order_id": "o2"}, {"items": [{"item_id": "i9", "product_id": "p4"}]}),
        call("list_tools", {}, {"tools": ["a", "b"]}),  # a read nobody uses
        call("get_product", {"product_id": "p4"}, {"variants": ["v7", "v8"]}),
        call("exchange", {"order_id": "o2", "item_id": "i9", "variant_id": "v8"}, {"ok": True}, True),
    ]
    assert d.chain_length(calls, "exchange the item of ann@x.com") == 5
    # values given in the instruction need no read: the order id is given, so find_user and get_user leave the path
    assert d.chain_length(calls, "exchange the item of order o2 for ann@x.com") == 3
    assert d.chain_length(calls[:5]) == 0  # no write
    # the chain ends at the FINAL write; an earlier write is not a source of values
    calls2 = [call("get", {}, {"x": 5}), call("w1", {"x": 5}, {"y": 6}, True), call("w2", {"y": 6}, {}, True)]
    assert d.chain_length(calls2) == 1
    assert d.chain_length([call("w", {}, {}, True)]) == 1


def test_chain_length_accepts_objects_and_rejects_missing_fields():
    class Call:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    calls = [Call(name="r", arguments={}, returned=[1, 2], is_write=False),
             Call(name="w", arguments={"a": 2}, returned=None, is_write=True)]
    assert d.chain_length(calls) == 2
    assert d.chain_length(calls, instruction=[2]) == 1
    with pytest.raises(InputError, match="is_write"):
        d.chain_length([{"name": "x", "arguments": {}, "returned": {}}])


def test_p_cover_bad_input():
    with pytest.raises(InputError, match="C must be <= T"):
        d.p_cover(3, 4, 1)
    assert math.isclose(float(d.p_cover(5, 0, 0)), 1.0)
