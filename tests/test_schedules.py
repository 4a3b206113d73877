"""Schedules lambda(k): constant and polynomial decay."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from creditlab.core.schedules import Decay, constant, decay


def test_decay_golden():
    lam = decay(0.8, start=20, end=30, power=3)
    # s = (k - 20) / 10: k = 22 -> 0.8 * 0.8^3 = 0.4096; k = 25 -> 0.8 * 0.125 = 0.1
    assert [lam(k) for k in (0, 19, 20, 22, 25, 30, 31, 10_000)] == pytest.approx(
        [0.8, 0.8, 0.8, 0.4096, 0.1, 0.0, 0.0, 0.0])
    assert decay(1.0, start=0, end=4, power=1)(1) == pytest.approx(0.75)


def test_constant():
    assert [constant(0.25)(k) for k in (0, 7, 1e6)] == [0.25, 0.25, 0.25]


def test_step_when_start_equals_end():
    lam = decay(1.0, start=5, end=5, power=2)
    assert (lam(4.999), lam(5), lam(6)) == (1.0, 0.0, 0.0)


@given(st.floats(0.0, 10.0), st.integers(0, 50), st.integers(0, 50), st.floats(0.1, 5.0))
def test_decay_is_monotone_and_bounded(l0, start, width, power):
    lam = decay(l0, start=start, end=start + width, power=power)
    values = [lam(k) for k in range(0, start + width + 3)]
    assert all(0.0 <= v <= l0 for v in values)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == 0.0


def test_schedules_pickle_and_print():
    lam = decay(0.5)
    assert pickle.loads(pickle.dumps(lam)) == lam
    assert repr(lam) == "Decay(l0=0.5, start=20.0, end=30.0, power=3.0)"
    assert isinstance(lam, Decay)


@pytest.mark.parametrize("kwargs,name", [
    ({"l0": float("nan")}, "l0"),
    ({"l0": float("inf")}, "l0"),
    ({"l0": 1.0, "start": 10, "end": 5}, "end"),
    ({"l0": 1.0, "start": -1, "end": 5}, "start"),
    ({"l0": 1.0, "power": 0}, "power"),
])
def test_bad_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        decay(**kwargs)


def test_bad_step():
    with pytest.raises(ValueError, match="k"):
        decay(1.0)(-1)
    with pytest.raises(ValueError, match="k"):
        constant(1.0)(float("nan"))


def test_the_schedule_record_names_a_registered_kind():
    """One record for every holder of a scheduled weight: the trainer integrations' settings and the labs'
    configs build the same :class:`Schedule`, which evaluates the registered kind."""
    from creditlab.core.schedules import SCHEDULES, Schedule
    from creditlab.integrations._common import CreditSettings

    assert list(SCHEDULES) == ["constant", "decay"]
    rec = Schedule("decay", l0=0.8, start=20, end=30, power=3)
    assert [rec(k) for k in (0, 22, 30)] == [decay(0.8)(k) for k in (0, 22, 30)]
    assert Schedule("constant", l0=0.3)(1e6) == 0.3
    assert pickle.loads(pickle.dumps(rec)) == rec
    settings = CreditSettings(prm_lambda=0.8, prm_schedule="decay")
    assert settings.schedule() == rec
    with pytest.raises(ValueError, match="schedule: unknown 'cosine'; valid: constant, decay"):
        Schedule("cosine")
    with pytest.raises(ValueError, match="end"):
        Schedule("decay", start=5, end=1)
